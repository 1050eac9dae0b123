// A stand-in libcuda.so.1 for CPU tests of hostfunc's real launch path (tests/native/test_hostfunc.py) and of
// launch_step's calls (tests/runner/test_native_launch.py).
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

// launch_step's entry points: each call is logged as (op, a, b, bytes); copies really copy (both sides are host
// memory here). Ops: 1 upload, 2 download, 3 event record (event, stream), 4 stream wait (stream, event),
// 5 graph launch (graph, stream), 6 elapsed time (first, second).
#define LOG_CAP 256
static uint64_t call_log[LOG_CAP][4];
static int log_len;

static int log_call(uint64_t op, const void* a, const void* b, size_t bytes) {
  pthread_mutex_lock(&mu);
  if (log_len < LOG_CAP) {
    call_log[log_len][0] = op;
    call_log[log_len][1] = (uint64_t)(uintptr_t)a;
    call_log[log_len][2] = (uint64_t)(uintptr_t)b;
    call_log[log_len][3] = bytes;
    log_len++;
  }
  pthread_mutex_unlock(&mu);
  return 0;
}

int cuMemcpyHtoDAsync_v2(unsigned long long dst, const void* src, size_t n, void* stream) {
  memcpy((void*)(uintptr_t)dst, src, n);
  return log_call(1, (void*)(uintptr_t)dst, stream, n);
}
int cuMemcpyDtoHAsync_v2(void* dst, unsigned long long src, size_t n, void* stream) {
  memcpy(dst, (const void*)(uintptr_t)src, n);
  return log_call(2, dst, stream, n);
}
int cuEventRecord(void* event, void* stream) { return log_call(3, event, stream, 0); }
int cuStreamWaitEvent(void* stream, void* event, unsigned flags) { (void)flags; return log_call(4, stream, event, 0); }
int cuGraphLaunch(void* graph, void* stream) { return stream == (void*)0xbad ? 400 : log_call(5, graph, stream, 0); }
// Op 6: an elapsed time (first, second event); the fake's time is the handles' difference / 1000 ms, and an event
// handle of 0xbad is one never recorded.
int cuEventElapsedTime(float* ms, void* first, void* second) {
  if (first == (void*)0xbad || second == (void*)0xbad) return 400;
  *ms = (float)((double)((intptr_t)second - (intptr_t)first) / 1000.0);
  return log_call(6, first, second, 0);
}

// Test controls of the log: copy up to `cap` entries into `out` (4 words each), return how many there were.
int fake_calls(uint64_t* out, int cap) {
  pthread_mutex_lock(&mu);
  int n = log_len < cap ? log_len : cap;
  memcpy(out, call_log, (size_t)n * sizeof call_log[0]);
  int total = log_len;
  log_len = 0;
  pthread_mutex_unlock(&mu);
  return total;
}

int cuGetProcAddress_v2(const char* name, void** fn, int version, uint64_t flags, int* status) {
  (void)version; (void)flags;
  static const struct { const char* name; void* fn; } table[] = {
      {"cuLaunchHostFunc", (void*)cuLaunchHostFunc}, {"cuStreamIsCapturing", (void*)cuStreamIsCapturing},
      {"cuStreamGetCaptureInfo", (void*)cuStreamGetCaptureInfo_v2}, {"cuCtxGetCurrent", (void*)cuCtxGetCurrent},
      {"cuCtxSetCurrent", (void*)cuCtxSetCurrent}, {"cuStreamGetCtx", (void*)cuStreamGetCtx},
      {"cuMemcpyHtoDAsync", (void*)cuMemcpyHtoDAsync_v2}, {"cuMemcpyDtoHAsync", (void*)cuMemcpyDtoHAsync_v2},
      {"cuEventRecord", (void*)cuEventRecord}, {"cuStreamWaitEvent", (void*)cuStreamWaitEvent},
      {"cuGraphLaunch", (void*)cuGraphLaunch}, {"cuEventElapsedTime", (void*)cuEventElapsedTime}};
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
