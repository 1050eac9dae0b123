// A GuidedRequest's counters (its `state`, the grammar node's RowState: engine/guided/csrc/matcher.h) read in
// native code. Its Python properties (`accepted`, `error`) go through an attribute getter and a pybind11 property
// a read, several times the cost of the walk's other reads of a row.
#pragma once

#include <pybind11/pybind11.h>

#include "../../guided/csrc/matcher.h"
#include "py_attrs.h"

namespace guided_state {

namespace py = pybind11;
using grammar_node::RowState;

// The RowState of GuidedRequest `g`, or nullptr where its `state` is not one (the caller then reads the
// properties). Borrowed: valid while `g` holds its state.
inline RowState* of(PyObject* g) {
  static PyObject* const name = py_attrs::intern("state");
  PyObject* state = PyObject_GetAttr(g, name);
  if (!state) {
    PyErr_Clear();
    return nullptr;
  }
  py::object held = py::reinterpret_steal<py::object>(state);
  py::detail::make_caster<RowState> caster;
  if (!caster.load(held, false)) return nullptr;
  return static_cast<RowState*>(caster.value);
}

}  // namespace guided_state
