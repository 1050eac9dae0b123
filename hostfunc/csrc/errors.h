// The error log of host callbacks: the trampoline records, Python takes (hostfunc.check_errors()).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdio>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace hostfunc {
namespace py = pybind11;

constexpr size_t kMaxErrors = 256;  // bounded: a failing callback in a graph replayed forever must not grow it
inline std::mutex g_err_mu;         // guards g_errors and g_dropped
inline std::vector<std::string> g_errors;
inline size_t g_dropped = 0;

inline std::string hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%zx", reinterpret_cast<size_t>(p));
  return buf;
}

inline void record_error(std::string msg) {
  std::lock_guard<std::mutex> lock(g_err_mu);
  if (g_errors.size() < kMaxErrors) g_errors.push_back(std::move(msg));
  else ++g_dropped;
}

inline size_t error_count() {
  std::lock_guard<std::mutex> lock(g_err_mu);
  return g_errors.size() + g_dropped;
}

inline std::string describe(PyObject* fn) {
  try {
    return py::repr(py::handle(fn)).cast<std::string>();
  } catch (...) {  // error_already_set has fetched (cleared) the Python error
    return "<callback>";
  }
}

// Records the pending Python exception with its traceback, and clears it. GIL held.
inline void record_exception(PyObject* fn) {
  py::error_already_set err;
  std::string msg = "exception in host callback " + describe(fn) + ":\n";
  try {
    py::object lines = py::module_::import("traceback").attr("format_exception")(err.type(), err.value(), err.trace());
    msg += py::str("").attr("join")(lines).cast<std::string>();
  } catch (...) {
    msg += err.what();
  }
  record_error(std::move(msg));
}

// Returns (messages, dropped) and clears the log. GIL held.
inline py::tuple take_errors() {
  std::vector<std::string> errors;
  size_t dropped;
  {
    std::lock_guard<std::mutex> lock(g_err_mu);
    errors.swap(g_errors);
    dropped = std::exchange(g_dropped, 0);
  }
  py::list messages;
  for (const std::string& msg : errors) messages.append(py::str(msg));
  return py::make_tuple(messages, dropped);
}

}  // namespace hostfunc
