// The registry of live packed callbacks, keyed by id.
//
// Each launch packs (fn, args, kwargs) into a heap Entry under a fresh id from a 64-bit counter that is never
// reused. The id is the handle returned to Python and the user data given to the driver; the registry maps
// id -> Entry*. Keying by id rather than by address means a graph replayed after its data was freed finds
// nothing (and reports it) even when a later launch's Entry got the freed address.
#pragma once

#include <pybind11/pybind11.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

namespace hostfunc {
namespace py = pybind11;

static_assert(sizeof(void*) >= sizeof(uint64_t), "an id travels as the driver's void* user data");

struct Entry {
  PyObject* fn;      // strong references
  PyObject* args;    // a tuple
  PyObject* kwargs;  // a dict, or nullptr for none
  uint64_t id;
  uint64_t owner;    // 0: none
  bool captured;
  uint64_t capture_id;
  bool standing = false;  // registered for native code (register_standing): free_all leaves it
};

inline std::mutex g_mu;  // guards g_live; the GIL before g_mu, never the reverse
inline std::unordered_map<uint64_t, Entry*> g_live;
inline std::atomic<uint64_t> g_next_id{1};  // 0 is never a handle

inline void* user_data(uint64_t id) { return reinterpret_cast<void*>(static_cast<uintptr_t>(id)); }
inline uint64_t id_of(void* data) { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(data)); }

inline Entry* pack(py::object fn, py::tuple args, py::object kwargs, uint64_t owner) {  // GIL held
  PyObject* kw = kwargs.is_none() || py::len(kwargs) == 0 ? nullptr : kwargs.release().ptr();
  uint64_t id = g_next_id.fetch_add(1, std::memory_order_relaxed);
  return new Entry{fn.release().ptr(), args.release().ptr(), kw, id, owner, false, 0};
}

// GIL held, on an ordinary Python thread (never the callback thread); e is no longer in g_live.
inline void destroy(Entry* e) {
  Py_DECREF(e->fn);
  Py_DECREF(e->args);
  Py_XDECREF(e->kwargs);
  delete e;
}

inline void register_entry(Entry* e) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_live.emplace(e->id, e);
}

inline bool unregister_entry(uint64_t id) {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_live.erase(id) == 1;
}

inline Entry* live_entry(uint64_t id) {  // g_mu held
  auto it = g_live.find(id);
  if (it == g_live.end()) throw py::key_error("unknown or already freed hostfunc handle " + std::to_string(id));
  return it->second;
}

}  // namespace hostfunc
