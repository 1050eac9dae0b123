// hostfunc._C: a C trampoline for cuLaunchHostFunc whose Python payload survives CUDA graph replays.
//
// Each launch packs (fn, args, kwargs) into a heap Entry; its address is the handle and the user data given
// to the driver. A registry of live entries (guarded by g_mu) detects unknown and double frees.
// Ownership: an eager entry (stream not capturing) belongs to the trampoline, which frees it right after the
// call; a captured entry belongs to the graph and lives until free()/free_all(). Python references are only
// touched with the GIL held. Lock order: GIL before g_mu, never the reverse.
#include <pybind11/pybind11.h>

#include <atomic>
#include <mutex>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "driver.h"
#include "errors.h"

namespace py = pybind11;

namespace hostfunc {
namespace {

struct Entry {
  PyObject* fn;      // strong references
  PyObject* args;    // a tuple
  PyObject* kwargs;  // a dict, or nullptr for none
  bool captured;
  uint64_t capture_id;
};

std::mutex g_mu;  // guards g_live
std::unordered_set<Entry*> g_live;

std::atomic<bool> g_debug{false};
std::atomic<bool> g_shutdown{false};
PyObject* g_debug_runner = nullptr;  // strong reference; set and read with the GIL held
thread_local int t_in_callback = 0;

Entry* pack(py::object fn, py::tuple args, py::object kwargs, bool captured) {
  PyObject* kw = kwargs.is_none() || py::len(kwargs) == 0 ? nullptr : kwargs.release().ptr();
  return new Entry{fn.release().ptr(), args.release().ptr(), kw, captured, 0};
}

void destroy(Entry* e) {  // GIL held; e no longer in g_live
  Py_DECREF(e->fn);
  Py_DECREF(e->args);
  Py_XDECREF(e->kwargs);
  delete e;
}

void register_entry(Entry* e) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_live.insert(e);
}

bool unregister_entry(Entry* e) {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_live.erase(e) == 1;
}

bool interpreter_alive() {
  if (g_shutdown.load(std::memory_order_acquire) || !Py_IsInitialized()) return false;
#if PY_VERSION_HEX >= 0x030D0000
  return !Py_IsFinalizing();
#else
  return !_Py_IsFinalizing();
#endif
}

PyObject* call(PyObject* fn, PyObject* args, PyObject* kwargs) {
  if (g_debug.load(std::memory_order_relaxed) && g_debug_runner)
    return PyObject_CallFunctionObjArgs(g_debug_runner, fn, args, kwargs ? kwargs : Py_None, nullptr);
  return PyObject_Call(fn, args, kwargs);
}

// Python's cyclic GC runs in whichever thread allocates past its threshold. In a callback it may finalize
// objects owning CUDA resources (a CUDAGraph, an Event, a Stream); CUDA calls are not permitted on the
// driver's callback thread, the destructor fails and the process aborts. So the collector is off while any
// callback runs: a count, since callbacks of other streams interleave when the GIL switches. GIL held.
int g_gc_holds = 0;
bool g_gc_was_enabled = false;

void gc_hold() {
  if (g_gc_holds++ == 0) g_gc_was_enabled = PyGC_Disable() == 1;
}

void gc_release() {
  if (--g_gc_holds == 0 && g_gc_was_enabled) PyGC_Enable();
}

// The trampoline body; GIL held.
void run_entry(Entry* e) {
  bool captured;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_live.count(e)) {
      record_error("host callback data " + hex(e) + " was freed but its graph was replayed; free graph data "
                   "only once the graph will not be replayed again (and after synchronising)");
      return;
    }
    captured = e->captured;
  }
  // Own references: while the callback runs the GIL may switch to a thread that frees a captured entry.
  PyObject* fn = e->fn;
  PyObject* args = e->args;
  PyObject* kwargs = e->kwargs;
  Py_INCREF(fn);
  Py_INCREF(args);
  Py_XINCREF(kwargs);
  ++t_in_callback;
  gc_hold();
  PyObject* result = call(fn, args, kwargs);
  gc_release();
  --t_in_callback;
  if (!result) record_exception(fn);
  Py_XDECREF(result);
  Py_DECREF(fn);
  Py_DECREF(args);
  Py_XDECREF(kwargs);
  if (!captured && unregister_entry(e)) destroy(e);
}

// True once this (driver) thread holds one extra, never released PyGILState count. That keeps its Python
// thread state alive between callbacks: creating and deleting one per callback costs several microseconds.
thread_local bool t_state_pinned = false;

void trampoline(void* data) {
  if (!interpreter_alive()) return;  // leak the entry: a dying interpreter's objects must not be touched
  PyGILState_STATE state = PyGILState_Ensure();
  if (state == PyGILState_UNLOCKED && !t_state_pinned) {
    PyGILState_Ensure();
    t_state_pinned = true;
  }
  run_entry(static_cast<Entry*>(data));
  PyGILState_Release(state);
}

// Makes the stream's context current on threads that never touched the CUDA runtime.
void ensure_context(const Driver& d, CUstream s) {
  if (!s || !d.ctx_get_current || !d.ctx_set_current || !d.stream_get_ctx) return;
  CUcontext current = nullptr;
  if (d.ctx_get_current(&current) != kCudaSuccess || current) return;
  CUcontext ctx = nullptr;
  if (d.stream_get_ctx(s, &ctx) == kCudaSuccess && ctx) d.ctx_set_current(ctx);
}

// Registers e and hands it to the driver. Runs without the GIL: the driver may block here until earlier
// callbacks on the stream ran, and those need the GIL.
// *captured is set before the launch: afterwards an eager e may already be freed by the trampoline.
std::string enqueue(const Driver& d, CUstream s, Entry* e, bool* captured) {
  ensure_context(d, s);
  int status = kCaptureStatusNone;
  if (CUresult rc = d.stream_is_capturing(s, &status); rc != kCudaSuccess)
    return "cuStreamIsCapturing failed: " + d.describe(rc);
  e->captured = status != kCaptureStatusNone;
  if (e->captured && d.get_capture_info) {
    int ignored = 0;
    uint64_t id = 0;
    if (d.get_capture_info(s, &ignored, &id, nullptr, nullptr, nullptr) == kCudaSuccess) e->capture_id = id;
  }
  *captured = e->captured;
  register_entry(e);
  if (CUresult rc = d.launch_host_func(s, &trampoline, e); rc != kCudaSuccess) {
    unregister_entry(e);
    return "cuLaunchHostFunc failed: " + d.describe(rc);
  }
  return "";
}

py::tuple launch(uintptr_t stream, py::object fn, py::tuple args, py::object kwargs) {
  const Driver& d = driver();
  if (!d.error.empty()) throw std::runtime_error("hostfunc: cannot launch a host callback: " + d.error);
  Entry* e = pack(std::move(fn), std::move(args), std::move(kwargs), false);
  std::string error;
  bool captured = false;
  {
    py::gil_scoped_release no_gil;
    error = enqueue(d, reinterpret_cast<CUstream>(stream), e, &captured);
  }
  if (!error.empty()) {
    destroy(e);
    throw std::runtime_error("hostfunc: " + error);
  }
  return py::make_tuple(reinterpret_cast<uintptr_t>(e), captured);
}

Entry* live_entry(uintptr_t handle) {  // caller holds g_mu
  Entry* e = reinterpret_cast<Entry*>(handle);
  if (!g_live.count(e)) throw py::key_error("unknown or already freed hostfunc handle " + hex(e));
  return e;
}

void free_handle(uintptr_t handle) {
  Entry* e;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    e = live_entry(handle);
    if (!e->captured)
      throw py::value_error("hostfunc handle " + hex(e) + " is an eager launch: its trampoline frees it after the "
                            "callback runs, so it must not be freed by hand");
    g_live.erase(e);
  }
  destroy(e);
}

size_t free_all() {
  std::vector<Entry*> doomed;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    for (Entry* e : g_live)
      if (e->captured) doomed.push_back(e);
    for (Entry* e : doomed) g_live.erase(e);
  }
  for (Entry* e : doomed) destroy(e);
  return doomed.size();
}

py::dict handle_info(uintptr_t handle) {
  std::lock_guard<std::mutex> lock(g_mu);
  Entry* e = live_entry(handle);
  py::dict info;
  info["captured"] = e->captured;
  info["capture_id"] = e->capture_id;
  return info;
}

py::dict stats() {
  size_t live = 0, captured = 0;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    live = g_live.size();
    for (Entry* e : g_live) captured += e->captured;
  }
  py::dict out;
  out["live"] = live;
  out["captured"] = captured;
  out["pending_eager"] = live - captured;
  out["errors"] = error_count();
  return out;
}

std::string driver_error() { return driver().error; }

void set_debug_runner(py::object runner) {
  Py_XDECREF(g_debug_runner);
  g_debug_runner = runner.is_none() ? nullptr : runner.release().ptr();
}

// Test hooks: the packing and trampoline paths without a GPU.
uintptr_t pack_for_test(py::object fn, py::tuple args, py::object kwargs, bool captured) {
  Entry* e = pack(std::move(fn), std::move(args), std::move(kwargs), captured);
  register_entry(e);
  return reinterpret_cast<uintptr_t>(e);
}

void invoke_for_test(uintptr_t handle) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    live_entry(handle);
  }
  trampoline(reinterpret_cast<void*>(handle));
}

}  // namespace
}  // namespace hostfunc

PYBIND11_MODULE(_C, m) {
  using namespace hostfunc;
  m.doc() = "specdec hostfunc: capturable CUDA host callbacks (see hostfunc/__init__.py)";
  m.def("launch", &launch, py::arg("stream"), py::arg("fn"), py::arg("args"), py::arg("kwargs"),
        "Pack (fn, args, kwargs) and cuLaunchHostFunc it on a raw stream handle; returns (handle, captured).");
  m.def("free", &free_handle, py::arg("handle"), "Free the data of a captured launch.");
  m.def("free_all", &free_all, "Free the data of every captured launch; returns how many.");
  m.def("handle_info", &handle_info, py::arg("handle"));
  m.def("stats", &stats);
  m.def("take_errors", &take_errors, "Return (messages, dropped) of callback errors and clear them.");
  m.def("driver_error", &driver_error, "Why host callbacks cannot be launched here ('' when they can).");
  m.def("in_callback", [] { return t_in_callback > 0; }, "True on a thread running a host callback.");
  m.def("set_debug", [](bool on) { g_debug.store(on); });
  m.def("debug", [] { return g_debug.load(); });
  m.def("set_debug_runner", &set_debug_runner, py::arg("runner"));
  m.def("shutdown", [] { g_shutdown.store(true, std::memory_order_release); },
        "Make later callbacks no-ops (called at interpreter exit).");
  m.def("_pack_for_test", &pack_for_test, py::arg("fn"), py::arg("args"), py::arg("kwargs"), py::arg("captured"));
  m.def("_invoke_for_test", &invoke_for_test, py::arg("handle"), "Run the trampoline body synchronously.");
  m.attr("MAX_ERRORS") = kMaxErrors;
}
