// Fields of Python classes with __slots__ (dataclass(slots=True)) read and written from native code at the offset
// their member descriptor gives, where PyObject_GetAttr looks the name up on each call (several times the cost).
// An object of any other class (a test's stand-in, a subclass) takes the named lookup, so a read or write always
// does what getattr / setattr would, errors included (raised as pybind11's error_already_set).
#pragma once

#include <pybind11/pybind11.h>
#include <structmember.h>

#include <cstdint>

#include "py_attrs.h"

namespace slots {

namespace py = pybind11;

class Field {
 public:
  // `public_name`: what other objects call the field, where the class's slot is a private one behind a property
  Field(PyObject* cls, const char* name, const char* public_name = nullptr)
      : cls_(reinterpret_cast<PyTypeObject*>(cls)), name_(py_attrs::intern(public_name ? public_name : name)) {
    Py_INCREF(cls);  // held for the process, as the interned name
    PyObject* descr = PyObject_GetAttrString(cls, name);
    if (!descr) {
      PyErr_Clear();
      return;
    }
    if (Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
      const PyMemberDef* m = reinterpret_cast<PyMemberDescrObject*>(descr)->d_member;
      if (m->type == T_OBJECT_EX && !(m->flags & READONLY)) offset_ = m->offset;
    }
    Py_DECREF(descr);
  }

  // A new reference to the value (AttributeError where the slot is empty, as Python's).
  py::object get(PyObject* obj) const {
    if (PyObject* v = fast(obj); v) return py::reinterpret_borrow<py::object>(v);
    return py_attrs::attr(obj, name_);
  }

  int64_t get_int(PyObject* obj) const {
    if (PyObject* v = fast(obj); v) return py_attrs::as_int(v);
    return py_attrs::as_int(py_attrs::attr(obj, name_).ptr());
  }

  bool is_none(PyObject* obj) const {
    if (PyObject* v = fast(obj); v) return v == Py_None;
    return py_attrs::attr(obj, name_).is_none();
  }

  bool truth(PyObject* obj) const {
    if (PyObject* v = fast(obj); v) return v == Py_True || (v != Py_False && py_attrs::truth(v));
    return py_attrs::truth(py_attrs::attr(obj, name_).ptr());
  }

  Py_ssize_t length(PyObject* obj) const {
    PyObject* v = fast(obj);
    if (v && PyList_CheckExact(v)) return PyList_GET_SIZE(v);
    Py_ssize_t n = PyObject_Length(v ? v : py_attrs::attr(obj, name_).ptr());
    if (n < 0) throw py::error_already_set();
    return n;
  }

  void set(PyObject* obj, PyObject* value) const {
    if (offset_ >= 0 && Py_IS_TYPE(obj, cls_)) {
      PyObject** at = slot(obj);
      PyObject* old = *at;
      Py_INCREF(value);
      *at = value;
      Py_XDECREF(old);
      return;
    }
    if (PyObject_SetAttr(obj, name_, value) < 0) throw py::error_already_set();
  }

  void set_int(PyObject* obj, int64_t value) const {
    PyObject* v = PyLong_FromLongLong(value);
    if (!v) throw py::error_already_set();
    set(obj, v);
    Py_DECREF(v);
  }

  bool direct() const { return offset_ >= 0; }

 private:
  PyObject** slot(PyObject* obj) const { return reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + offset_); }
  // the slot's value (borrowed) for an object of the class itself, else nullptr (empty slot too: the named lookup
  // then raises AttributeError)
  PyObject* fast(PyObject* obj) const { return offset_ >= 0 && Py_IS_TYPE(obj, cls_) ? *slot(obj) : nullptr; }

  PyTypeObject* cls_;
  PyObject* name_;
  Py_ssize_t offset_ = -1;
};

// A class of the engine, imported when native code first needs it (not at module import: no import cycle).
inline PyObject* class_of(const char* module, const char* name) {
  py::object cls = py::module_::import(module).attr(name);
  return cls.release().ptr();  // held for the process
}

// The one T of the process, made at its first use (after Python is up) and never destroyed: its Python
// references are not dropped after the interpreter has finalized.
template <class T>
const T& once() {
  static const T* made = new T;
  return *made;
}

}  // namespace slots
