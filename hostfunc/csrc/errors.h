// The error log of host callbacks: the trampoline records (owner, message), Python takes them by owner
// (hostfunc.check_errors(owner) / take_errors(owner)). Owner 0 means none.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "graveyard.h"

namespace hostfunc {
namespace py = pybind11;

constexpr size_t kMaxErrors = 256;  // bounded: a failing callback in a graph replayed forever must not grow it

struct ErrorRecord {
  uint64_t owner;
  std::string message;
};

inline std::mutex g_err_mu;  // guards the three below
inline std::vector<ErrorRecord> g_errors;  // at most kMaxErrors, oldest first
inline std::vector<std::pair<uint64_t, size_t>> g_dropped;  // (owner, count); at most kMaxErrors owners
inline size_t g_dropped_unattributed = 0;  // drops of owners that did not fit in g_dropped

inline void count_dropped(uint64_t owner) {  // g_err_mu held
  for (auto& [o, n] : g_dropped)
    if (o == owner) {
      ++n;
      return;
    }
  if (g_dropped.size() < kMaxErrors) g_dropped.emplace_back(owner, 1);
  else ++g_dropped_unattributed;
}

// The log is full. An owner with no message in it takes the place of the newest message of the owner holding
// the most, so one owner's graph failing on every replay cannot hide every other owner's errors (each owner
// keeps its first message while there are at most kMaxErrors of them). g_err_mu held.
inline bool make_room_for(uint64_t owner) {
  for (const ErrorRecord& r : g_errors)
    if (r.owner == owner) return false;
  std::unordered_map<uint64_t, size_t> held;
  for (const ErrorRecord& r : g_errors) ++held[r.owner];
  auto most = std::max_element(held.begin(), held.end(), [](auto& a, auto& b) { return a.second < b.second; });
  if (most == held.end() || most->second < 2) return false;
  auto victim = std::find_if(g_errors.rbegin(), g_errors.rend(),
                             [&](const ErrorRecord& r) { return r.owner == most->first; });
  count_dropped(victim->owner);
  g_errors.erase(std::next(victim).base());
  return true;
}

inline void record_error(uint64_t owner, std::string msg) {
  std::lock_guard<std::mutex> lock(g_err_mu);
  if (g_errors.size() < kMaxErrors || make_room_for(owner)) g_errors.push_back({owner, std::move(msg)});
  else count_dropped(owner);
}

inline size_t error_count() {
  std::lock_guard<std::mutex> lock(g_err_mu);
  size_t n = g_errors.size() + g_dropped_unattributed;
  for (const auto& d : g_dropped) n += d.second;
  return n;
}

inline std::string describe(PyObject* fn) {
  try {
    return py::repr(py::handle(fn)).cast<std::string>();
  } catch (...) {  // error_already_set has fetched (cleared) the Python error
    return "<callback>";
  }
}

// Records the pending Python exception with its traceback, and clears it. GIL held, on the callback thread:
// the exception is buried, not dropped, since its traceback's frames hold the callback's locals.
inline void record_exception(PyObject* fn, uint64_t owner) {
#if PY_VERSION_HEX >= 0x030C0000
  PyObject* value = PyErr_GetRaisedException();
  PyObject* type = value ? Py_NewRef(reinterpret_cast<PyObject*>(Py_TYPE(value))) : nullptr;
  PyObject* trace = value ? PyException_GetTraceback(value) : nullptr;
#else
  PyObject *type = nullptr, *value = nullptr, *trace = nullptr;
  PyErr_Fetch(&type, &value, &trace);
  PyErr_NormalizeException(&type, &value, &trace);
  if (value && trace) PyException_SetTraceback(value, trace);
#endif
  std::string msg = "exception in host callback " + describe(fn) + ":\n";
  try {
    if (!value) throw std::runtime_error("the callback failed without setting an exception");
    py::object lines = py::module_::import("traceback").attr("format_exception")(
        py::handle(type), py::handle(value), trace ? py::handle(trace) : py::none());
    msg += py::str("").attr("join")(lines).cast<std::string>();
  } catch (const std::exception& err) {
    msg += err.what();
  }
  record_error(owner, std::move(msg));
  release_later(trace);
  release_later(value);
  release_later(type);
}

// Returns (records, dropped) of `owner` (all owners when empty) and clears them: records is a list of
// (owner, message), dropped a list of (owner, count), with owner None for the unattributed drops. GIL held.
inline py::tuple take_errors(std::optional<uint64_t> owner) {
  std::vector<ErrorRecord> taken;
  std::vector<std::pair<uint64_t, size_t>> dropped;
  size_t unattributed = 0;
  {
    std::lock_guard<std::mutex> lock(g_err_mu);
    if (!owner) {
      taken.swap(g_errors);
      dropped.swap(g_dropped);
      unattributed = std::exchange(g_dropped_unattributed, 0);
    } else {
      auto mine = std::stable_partition(g_errors.begin(), g_errors.end(),
                                        [&](const ErrorRecord& r) { return r.owner != *owner; });
      std::move(mine, g_errors.end(), std::back_inserter(taken));
      g_errors.erase(mine, g_errors.end());
      auto d = std::find_if(g_dropped.begin(), g_dropped.end(), [&](auto& p) { return p.first == *owner; });
      if (d != g_dropped.end()) {
        dropped.push_back(*d);
        g_dropped.erase(d);
      }
    }
  }
  py::list records, drops;
  for (const ErrorRecord& r : taken) records.append(py::make_tuple(r.owner, py::str(r.message)));
  for (const auto& [o, n] : dropped) drops.append(py::make_tuple(o, n));
  if (unattributed) drops.append(py::make_tuple(py::none(), unattributed));
  return py::make_tuple(records, drops);
}

}  // namespace hostfunc
