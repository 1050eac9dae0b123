// The engine process's walk over a step's outputs (engine/server/processes/engine_process.py, _publish) for the
// common row: a request streaming token ids only that did not finish. Its sub, choice, count and ids go into the
// columns of its API process's Outputs frame; every other output is handed back, in order, for the Python walk.
// Tests hold the frames equal to the Python walk's.
#include <pybind11/pybind11.h>

#include "py_attrs.h"

namespace py = pybind11;

namespace {

struct FrameNames {
  PyObject *subs = py_attrs::intern("subs"), *choices = py_attrs::intern("choices"),
           *counts = py_attrs::intern("counts"), *ids = py_attrs::intern("ids");
};

void append(PyObject* list, PyObject* item) {
  if (PyList_Append(list, item) < 0) throw py::error_already_set();
}

// outputs: RequestOutput tuples (request_id, new_token_ids, new_text, finished, ...); routes: request id ->
// (client, sub, choice, text, whole); frames: client -> Outputs, made by new_frame() where missing.
py::list publish_columns(py::list outputs, py::dict routes, py::dict frames, py::object new_frame) {
  static const FrameNames names;
  py::list rest;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(outputs.ptr()); ++i) {
    PyObject* out = PyList_GET_ITEM(outputs.ptr(), i);
    if (!PyTuple_Check(out) || PyTuple_GET_SIZE(out) < 4) throw py::type_error("publish_columns: not an output");
    PyObject* route = PyDict_GetItemWithError(routes.ptr(), PyTuple_GET_ITEM(out, 0));
    if (!route) {
      if (PyErr_Occurred()) throw py::error_already_set();
      continue;                                       // an undone choice's abort
    }
    if (!PyTuple_Check(route) || PyTuple_GET_SIZE(route) != 5) throw py::type_error("publish_columns: bad route");
    if (py_attrs::truth(PyTuple_GET_ITEM(route, 4)) || py_attrs::truth(PyTuple_GET_ITEM(out, 3))) {
      append(rest.ptr(), out);
      continue;
    }
    PyObject* client = PyTuple_GET_ITEM(route, 0);
    PyObject* frame = PyDict_GetItemWithError(frames.ptr(), client);
    py::object made;
    if (!frame) {
      if (PyErr_Occurred()) throw py::error_already_set();
      made = new_frame();
      if (PyDict_SetItem(frames.ptr(), client, made.ptr()) < 0) throw py::error_already_set();
      frame = made.ptr();
    }
    PyObject* ids = PyTuple_GET_ITEM(out, 1);
    py::object count = py::reinterpret_steal<py::object>(PyLong_FromSsize_t(PyObject_Length(ids)));
    if (!count || PyErr_Occurred()) throw py::error_already_set();
    append(py_attrs::attr(frame, names.subs).ptr(), PyTuple_GET_ITEM(route, 1));
    append(py_attrs::attr(frame, names.choices).ptr(), PyTuple_GET_ITEM(route, 2));
    append(py_attrs::attr(frame, names.counts).ptr(), count.ptr());
    py::object column = py_attrs::attr(frame, names.ids);
    py::object tail = py::reinterpret_steal<py::object>(PySequence_InPlaceConcat(column.ptr(), ids));
    if (!tail) throw py::error_already_set();
  }
  return rest;
}

}  // namespace

void bind_publish_walk(py::module_& m) {
  m.def("publish_columns", &publish_columns, py::arg("outputs"), py::arg("routes"), py::arg("frames"),
        py::arg("new_frame"),
        "The outputs that bring only token ids into their client's frame's columns; returns the others, in order.");
}
