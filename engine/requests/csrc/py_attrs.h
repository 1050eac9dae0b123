// Python objects' attributes read from native code (engine.requests._hostpath, engine.runner._rows). Each call
// returns a new reference or a value, or raises the Python error as pybind11's error_already_set, so a failing
// read fails the way the Python walk it stands for would.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>

namespace py_attrs {

namespace py = pybind11;

inline py::object attr(PyObject* obj, PyObject* name) {
  PyObject* value = PyObject_GetAttr(obj, name);
  if (!value) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(value);
}

inline int64_t as_int(PyObject* value) {
  int64_t v = PyLong_AsLongLong(value);
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  return v;
}

inline double as_float(PyObject* value) {
  double v = PyFloat_AsDouble(value);
  if (v == -1.0 && PyErr_Occurred()) throw py::error_already_set();
  return v;
}

inline bool truth(PyObject* value) {
  int t = PyObject_IsTrue(value);
  if (t < 0) throw py::error_already_set();
  return t;
}

inline int64_t int_attr(PyObject* obj, PyObject* name) { return as_int(attr(obj, name).ptr()); }

inline Py_ssize_t len_attr(PyObject* obj, PyObject* name) {
  Py_ssize_t n = PyObject_Length(attr(obj, name).ptr());
  if (n < 0) throw py::error_already_set();
  return n;
}

inline void append(PyObject* list, PyObject* value) {
  if (PyList_Append(list, value) < 0) throw py::error_already_set();
}

inline void set_attr(PyObject* obj, PyObject* name, PyObject* value) {
  if (PyObject_SetAttr(obj, name, value) < 0) throw py::error_already_set();
}

// An attribute name, interned once and held for the process.
inline PyObject* intern(const char* text) {
  PyObject* name = PyUnicode_InternFromString(text);
  if (!name) throw py::error_already_set();
  return name;
}

}  // namespace py_attrs
