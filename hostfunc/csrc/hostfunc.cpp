// hostfunc._C: a C trampoline for cuLaunchHostFunc whose Python payload survives CUDA graph replays.
//
// Each launch packs (fn, args, kwargs) under a fresh id (registry.h); the id is the handle and the driver's
// user data. Ownership: an eager entry (stream not capturing) belongs to the trampoline, which takes it out
// of the registry when it runs; a captured entry belongs to the graph and lives until free()/free_all().
// Python references are only touched with the GIL held, and the callback thread never drops a last one
// (graveyard.h). Lock order: the GIL before any of g_mu, g_err_mu, g_grave_mu; none is held with another.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "driver.h"
#include "errors.h"
#include "graveyard.h"
#include "registry.h"
#include "step_launch.h"

namespace py = pybind11;

namespace hostfunc {
namespace {

std::atomic<bool> g_debug{false};
std::atomic<bool> g_shutdown{false};
PyObject* g_debug_runner = nullptr;  // strong reference; set and read with the GIL held

bool interpreter_alive() {
  if (g_shutdown.load(std::memory_order_acquire) || !Py_IsInitialized()) return false;
#if PY_VERSION_HEX >= 0x030D0000
  return !Py_IsFinalizing();
#else
  return !_Py_IsFinalizing();
#endif
}

void not_in_callback(const char* what) {
  if (t_in_callback > 0)
    throw std::runtime_error(std::string("hostfunc: ") + what + " inside a host callback: it would release "
                             "Python objects (maybe CUDA ones) on the driver's callback thread");
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
void run_entry(uint64_t id) {
  Entry* e = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (auto it = g_live.find(id); it != g_live.end()) {
      e = it->second;
      if (!e->captured) g_live.erase(it);  // an eager entry runs once: from here on it is ours, not live
    }
  }
  if (!e) {
    record_error(0, "host callback data (handle " + std::to_string(id) + ") was freed but its graph was "
                 "replayed; free graph data only once the graph will not be replayed again (and after "
                 "synchronising)");
    return;
  }
  PyObject* fn = e->fn;
  PyObject* args = e->args;
  PyObject* kwargs = e->kwargs;
  const uint64_t owner = e->owner;
  if (e->captured) {  // own references: while the callback runs the GIL may switch to a thread that frees e
    Py_INCREF(fn);
    Py_INCREF(args);
    Py_XINCREF(kwargs);
  } else {
    delete e;  // its references are now ours
  }
  gc_hold();  // also over the error recording and releases below, which allocate
  ++t_in_callback;
  PyObject* result = call(fn, args, kwargs);
  --t_in_callback;
  if (!result) record_exception(fn, owner);
  release_later(result);
  release_later(kwargs);
  release_later(args);
  release_later(fn);
  gc_release();
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
  run_entry(id_of(data));
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

// Registers e and hands its id to the driver. Runs without the GIL: the driver may block here until earlier
// callbacks on the stream ran, and those need the GIL. *captured is set before the launch: afterwards an
// eager e may already have been run and deleted by the trampoline.
std::string enqueue(const Driver& d, CUstream s, Entry* e, bool* captured) {
  ensure_context(d, s);
  int status = kCaptureStatusNone;
  if (CUresult rc = d.stream_is_capturing(s, &status); rc != kCudaSuccess)
    return "cuStreamIsCapturing failed: " + d.describe(rc);
  e->captured = status != kCaptureStatusNone;
  if (e->captured && d.get_capture_info) {
    int ignored = 0;
    uint64_t capture = 0;
    if (d.get_capture_info(s, &ignored, &capture, nullptr, nullptr, nullptr) == kCudaSuccess)
      e->capture_id = capture;
  }
  *captured = e->captured;
  const uint64_t id = e->id;
  register_entry(e);
  if (CUresult rc = d.launch_host_func(s, &trampoline, user_data(id)); rc != kCudaSuccess) {
    unregister_entry(id);
    return "cuLaunchHostFunc failed: " + d.describe(rc);
  }
  return "";
}

// Enqueues a native host function (no Python, no GIL on the driver's thread). Its data belongs to the caller,
// who keeps it alive while any graph that captured it may replay.
bool launch_native(uintptr_t stream, uintptr_t fn, uintptr_t data) {
  if (!fn) throw py::value_error("hostfunc: launch_native needs a function address");
  const Driver& d = driver();
  if (!d.error.empty()) throw std::runtime_error("hostfunc: cannot launch a host callback: " + d.error);
  CUstream s = reinterpret_cast<CUstream>(stream);
  std::string error;
  int status = kCaptureStatusNone;
  {
    py::gil_scoped_release no_gil;
    ensure_context(d, s);
    if (CUresult rc = d.stream_is_capturing(s, &status); rc != kCudaSuccess)
      error = "cuStreamIsCapturing failed: " + d.describe(rc);
    else if (CUresult rc2 = d.launch_host_func(s, reinterpret_cast<CUhostFn>(fn), reinterpret_cast<void*>(data));
             rc2 != kCudaSuccess)
      error = "cuLaunchHostFunc failed: " + d.describe(rc2);
  }
  if (!error.empty()) throw std::runtime_error("hostfunc: " + error);
  return status != kCaptureStatusNone;
}

// A standing entry: (fn, args, kwargs) kept like a captured launch's until free(), run by native code that
// calls trampoline(handle) (the address `trampoline_address` gives) on whatever thread it is on.
uint64_t register_standing(py::object fn, py::tuple args, py::object kwargs, uint64_t owner) {
  drain_graveyard();
  Entry* e = pack(std::move(fn), std::move(args), std::move(kwargs), owner);
  e->captured = true;
  e->standing = true;
  register_entry(e);
  return e->id;
}

py::tuple launch(uintptr_t stream, py::object fn, py::tuple args, py::object kwargs, uint64_t owner) {
  drain_graveyard();
  const Driver& d = driver();
  if (!d.error.empty()) throw std::runtime_error("hostfunc: cannot launch a host callback: " + d.error);
  Entry* e = pack(std::move(fn), std::move(args), std::move(kwargs), owner);
  const uint64_t id = e->id;
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
  return py::make_tuple(id, captured);
}

void free_handle(uint64_t id) {
  not_in_callback("freeing host callback data");
  drain_graveyard();
  Entry* e;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    e = live_entry(id);
    if (!e->captured)
      throw py::value_error("hostfunc handle " + std::to_string(id) + " is an eager launch: its trampoline "
                            "releases it after the callback runs, so it must not be freed by hand");
    g_live.erase(id);
  }
  destroy(e);
}

size_t free_all() {
  not_in_callback("freeing host callback data");
  drain_graveyard();
  std::vector<Entry*> doomed;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    for (const auto& [id, e] : g_live)
      if (e->captured && !e->standing) doomed.push_back(e);
    for (Entry* e : doomed) g_live.erase(e->id);
  }
  for (Entry* e : doomed) destroy(e);
  return doomed.size();
}

py::dict handle_info(uint64_t id) {
  std::lock_guard<std::mutex> lock(g_mu);
  Entry* e = live_entry(id);
  py::dict info;
  info["captured"] = e->captured;
  info["capture_id"] = e->capture_id;
  info["owner"] = e->owner;
  return info;
}

py::dict stats() {
  drain_graveyard();
  size_t live = 0, captured = 0, standing = 0;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    for (const auto& [id, e] : g_live) {
      standing += e->standing;
      captured += e->captured && !e->standing;
    }
    live = g_live.size() - standing;
  }
  py::dict out;
  out["live"] = live;  // launches: standing entries belong to their owners and are counted apart
  out["captured"] = captured;
  out["pending_eager"] = live - captured;
  out["standing"] = standing;
  out["errors"] = error_count();
  out["graveyard"] = graveyard_size();
  return out;
}

std::string driver_error() { return driver().error; }

void set_debug_runner(py::object runner) {
  Py_XDECREF(g_debug_runner);
  g_debug_runner = runner.is_none() ? nullptr : runner.release().ptr();
}

// Test hooks: the packing and trampoline paths without a GPU.
uint64_t pack_for_test(py::object fn, py::tuple args, py::object kwargs, bool captured, uint64_t owner) {
  drain_graveyard();  // like launch()
  Entry* e = pack(std::move(fn), std::move(args), std::move(kwargs), owner);
  e->captured = captured;
  register_entry(e);
  return e->id;
}

// Called without the GIL, like the driver calls the trampoline.
void invoke_for_test(uint64_t id, bool check) {
  if (check) {
    std::lock_guard<std::mutex> lock(g_mu);
    live_entry(id);
  }
  trampoline(user_data(id));
}

}  // namespace
}  // namespace hostfunc

PYBIND11_MODULE(_C, m) {
  using namespace hostfunc;
  m.doc() = "specdec hostfunc: capturable CUDA host callbacks (see hostfunc/__init__.py)";
  m.def("launch", &launch, py::arg("stream"), py::arg("fn"), py::arg("args"), py::arg("kwargs"),
        py::arg("owner") = 0,
        "Pack (fn, args, kwargs) and cuLaunchHostFunc it on a raw stream handle; returns (handle, captured).");
  m.def("launch_native", &launch_native, py::arg("stream"), py::arg("fn"), py::arg("data"),
        "cuLaunchHostFunc a native function address with its data pointer; returns whether it was captured.");
  m.def("register_standing", &register_standing, py::arg("fn"), py::arg("args"), py::arg("kwargs"),
        py::arg("owner") = 0, "Pack (fn, args, kwargs) for native code to run through the trampoline; free() it.");
  m.def("trampoline_address", [] { return reinterpret_cast<uintptr_t>(&trampoline); },
        "Address of void trampoline(void* handle): takes the GIL and runs a registered entry.");
  m.def("free", &free_handle, py::arg("handle"), "Free the data of a captured launch.");
  m.def("free_all", &free_all, "Free the data of every captured launch; returns how many.");
  m.def("handle_info", &handle_info, py::arg("handle"));
  m.def("stats", &stats, "Release the graveyard, then count live entries, errors and what is still buried.");
  m.def("take_errors", [](std::optional<uint64_t> owner) {
          drain_graveyard();
          return take_errors(owner);
        }, py::arg("owner") = py::none(),
        "Return (records, dropped) of callback errors of owner (None: all) and clear them.");
  m.def("collect", &drain_graveyard, "Release what callbacks left in the graveyard; returns how many objects.");
  m.def("graveyard_size", &graveyard_size, "Objects waiting in the graveyard (releases nothing).");
  m.def("driver_error", &driver_error, "Why host callbacks cannot be launched here ('' when they can).");
  m.def("in_callback", [] { return t_in_callback > 0; }, "True on a thread running a host callback.");
  m.def("set_debug", [](bool on) { g_debug.store(on); });
  m.def("debug", [] { return g_debug.load(); });
  m.def("set_debug_runner", &set_debug_runner, py::arg("runner"));
  m.def("shutdown", [] { g_shutdown.store(true, std::memory_order_release); },
        "Make later callbacks no-ops (called at interpreter exit).");
  m.def("_pack_for_test", &pack_for_test, py::arg("fn"), py::arg("args"), py::arg("kwargs"), py::arg("captured"),
        py::arg("owner") = 0);
  m.def("_invoke_for_test", &invoke_for_test, py::arg("handle"), py::arg("check") = true,
        py::call_guard<py::gil_scoped_release>(),
        "Run the trampoline synchronously on this thread, without the GIL (the trampoline takes it). "
        "check=False skips the KeyError for an unknown handle, like a stale graph replay.");
  m.attr("MAX_ERRORS") = kMaxErrors;
  register_step_launch(m);
}
