// Deferred releases: Python references that must not be dropped on the driver's callback thread.
//
// Dropping the last reference to an object runs its destructor on the dropping thread. For a CUDA tensor,
// event, stream or graph the destructor calls CUDA, which is not permitted on the driver's callback thread
// (the call fails, and can abort the process). So the trampoline never drops a last reference: it buries it
// here, and ordinary Python threads release the graveyard (launch, free, free_all, take_errors, stats and
// hostfunc.collect()). Lock order: the GIL before g_grave_mu; no Python code runs while it is held.
#pragma once

#include <pybind11/pybind11.h>

#include <mutex>
#include <vector>

namespace hostfunc {

inline thread_local int t_in_callback = 0;  // > 0 while this thread runs a host callback
inline std::mutex g_grave_mu;               // guards g_graveyard
inline std::vector<PyObject*> g_graveyard;  // owned references

// Gives up one owned reference (nullptr is ignored) without running a destructor here. GIL held.
inline void release_later(PyObject* o) {
  if (!o) return;
  // With the GIL held no other thread changes the count, so a reference that is not the last is dropped at
  // once: only objects this thread would have destroyed (e.g. an eager launch's args tuple) are buried.
  if (Py_REFCNT(o) > 1) {
    Py_DECREF(o);
    return;
  }
  std::lock_guard<std::mutex> lock(g_grave_mu);
  g_graveyard.push_back(o);
}

// Releases everything buried so far and returns how many; a no-op inside a callback. GIL held.
inline size_t drain_graveyard() {
  if (t_in_callback > 0) return 0;
  std::vector<PyObject*> dead;
  {
    std::lock_guard<std::mutex> lock(g_grave_mu);
    dead.swap(g_graveyard);
  }
  // Destructors run Python code that may launch (and drain) again, or let a callback bury more: no lock here.
  for (PyObject* o : dead) Py_DECREF(o);
  return dead.size();
}

inline size_t graveyard_size() {
  std::lock_guard<std::mutex> lock(g_grave_mu);
  return g_graveyard.size();
}

}  // namespace hostfunc
