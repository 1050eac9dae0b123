// A stand-in libcuda.so.1 for CPU tests of hostfunc's real launch path (tests/test_hostfunc.py).
//
// Host functions run in FIFO order on one worker thread, like the driver's per-stream callback thread. The
// queue is small, so cuLaunchHostFunc blocks when it is full: a launcher that kept the GIL there would
// deadlock against the callbacks, exactly as on a GPU. Capture is simulated: fake_begin_capture(stream)
// makes launches on that stream record into a graph, fake_replay(n) enqueues it n times, fake_sync()
// waits for the queue to drain. Build: cc -shared -fPIC -o libcuda.so.1 fake_libcuda.c -lpthread
#include <pthread.h>
#include <stdint.h>
#include <string.h>

typedef void (*host_fn)(void*);
typedef struct { host_fn fn; void* data; } item;

#define QUEUE_CAP 8
#define GRAPH_CAP 64
static item queue[QUEUE_CAP];
static int head, count, busy;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t changed = PTHREAD_COND_INITIALIZER;
static pthread_t worker;
static int started;
static void* capture_stream;
static int capturing;
static uint64_t capture_id;
static item graph[GRAPH_CAP];
static int graph_len;

static void* work(void* unused) {
  (void)unused;
  pthread_mutex_lock(&mu);
  for (;;) {
    while (count == 0) pthread_cond_wait(&changed, &mu);
    item it = queue[head];
    head = (head + 1) % QUEUE_CAP;
    count--;
    busy = 1;
    pthread_cond_broadcast(&changed);
    pthread_mutex_unlock(&mu);
    it.fn(it.data);
    pthread_mutex_lock(&mu);
    busy = 0;
    pthread_cond_broadcast(&changed);
  }
  return NULL;
}

static void push(item it) {  // mu held
  while (count == QUEUE_CAP) pthread_cond_wait(&changed, &mu);
  queue[(head + count) % QUEUE_CAP] = it;
  count++;
  pthread_cond_broadcast(&changed);
}

int cuInit(unsigned flags) {
  (void)flags;
  pthread_mutex_lock(&mu);
  if (!started) started = pthread_create(&worker, NULL, work, NULL) == 0;
  pthread_mutex_unlock(&mu);
  return started ? 0 : 999;
}

int cuDriverGetVersion(int* version) { *version = 13000; return 0; }
int cuGetErrorName(int rc, const char** s) { *s = rc == 900 ? "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED" : "CUDA_ERROR_UNKNOWN"; return 0; }
int cuGetErrorString(int rc, const char** s) { (void)rc; *s = "fake driver error"; return 0; }
int cuCtxGetCurrent(void** ctx) { *ctx = (void*)0x1; return 0; }
int cuCtxSetCurrent(void* ctx) { (void)ctx; return 0; }
int cuStreamGetCtx(void* stream, void** ctx) { (void)stream; *ctx = (void*)0x1; return 0; }

int cuStreamIsCapturing(void* stream, int* status) {
  pthread_mutex_lock(&mu);
  *status = capturing && stream == capture_stream;
  pthread_mutex_unlock(&mu);
  return 0;
}

int cuStreamGetCaptureInfo_v2(void* stream, int* status, uint64_t* id, void** g, const void*** deps, size_t* n) {
  (void)g; (void)deps; (void)n;
  cuStreamIsCapturing(stream, status);
  *id = *status ? capture_id : 0;
  return 0;
}

int cuLaunchHostFunc(void* stream, host_fn fn, void* data) {
  if (stream == (void*)0xbad) return 900;
  item it = {fn, data};
  pthread_mutex_lock(&mu);
  int rc = 0;
  if (capturing && stream == capture_stream) {
    if (graph_len < GRAPH_CAP) graph[graph_len++] = it;
    else rc = 2;
  } else {
    push(it);
  }
  pthread_mutex_unlock(&mu);
  return rc;
}

int cuGetProcAddress_v2(const char* name, void** fn, int version, uint64_t flags, int* status) {
  (void)version; (void)flags;
  static const struct { const char* name; void* fn; } table[] = {
      {"cuLaunchHostFunc", (void*)cuLaunchHostFunc}, {"cuStreamIsCapturing", (void*)cuStreamIsCapturing},
      {"cuStreamGetCaptureInfo", (void*)cuStreamGetCaptureInfo_v2}, {"cuCtxGetCurrent", (void*)cuCtxGetCurrent},
      {"cuCtxSetCurrent", (void*)cuCtxSetCurrent}, {"cuStreamGetCtx", (void*)cuStreamGetCtx}};
  for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
    if (strcmp(name, table[i].name) == 0) { *fn = table[i].fn; *status = 0; return 0; }
  *fn = NULL;
  *status = 1;
  return 500;
}

// Test controls.
void fake_begin_capture(void* stream) {
  pthread_mutex_lock(&mu);
  capture_stream = stream;
  capturing = 1;
  capture_id++;
  graph_len = 0;
  pthread_mutex_unlock(&mu);
}

void fake_end_capture(void) { pthread_mutex_lock(&mu); capturing = 0; pthread_mutex_unlock(&mu); }

void fake_replay(int times) {
  pthread_mutex_lock(&mu);
  for (int t = 0; t < times; t++)
    for (int i = 0; i < graph_len; i++) push(graph[i]);
  pthread_mutex_unlock(&mu);
}

void fake_sync(void) {
  pthread_mutex_lock(&mu);
  while (count || busy) pthread_cond_wait(&changed, &mu);
  pthread_mutex_unlock(&mu);
}
