// engine/guided/snapshot.py guided_columns in native code: a step's sampling rows as its guided-row snapshot reads
// them. The Python function is the definition; tests hold the two equal.
#include <pybind11/pybind11.h>

#include <algorithm>

#include "fields.h"
#include "guided_state.h"
#include "py_attrs.h"

namespace py = pybind11;

namespace {

using py_attrs::append;

void append_int(PyObject* list, int64_t value) {
  py::object v = py::reinterpret_steal<py::object>(PyLong_FromLongLong(value));
  if (!v) throw py::error_already_set();
  append(list, v.ptr());
}

// -> (sample, requests, starts, offsets, feed, sources, unguided), lists, as guided_columns returns them
py::tuple guided_columns(py::list rows) {
  const auto& f = slots::once<row_fields::SeqFields>();
  const auto& r = slots::once<row_fields::RowFields>();
  static PyObject* const accepted = py_attrs::intern("accepted");
  py::list sample, requests, starts, offsets, feed, sources, unguided;
  append_int(offsets.ptr(), 0);
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(rows.ptr()); ++i) {
    PyObject* row = PyList_GET_ITEM(rows.ptr(), i);
    if (!r.sample.truth(row)) continue;
    py::object seq_obj = r.seq.get(row);
    PyObject* seq = seq_obj.ptr();
    py::object g = f.guided.get(seq);
    py::object idx = r.sample_idx.get(row);
    if (g.is_none()) {
      append(unguided.ptr(), idx.ptr());
      continue;
    }
    const grammar_node::RowState* state = guided_state::of(g.ptr());
    py::object lo = state ? py::int_(state->accepted.load()) : py_attrs::attr(g.ptr(), accepted);
    append(sample.ptr(), idx.ptr());
    append(requests.ptr(), g.ptr());
    append(starts.ptr(), lo.ptr());
    py::object out = f.output.get(seq);
    if (!PyList_CheckExact(out.ptr())) throw py::type_error("a sequence's output_token_ids is not a list");
    const Py_ssize_t n = PyList_GET_SIZE(out.ptr());
    for (Py_ssize_t j = std::max<Py_ssize_t>(0, py_attrs::as_int(lo.ptr())); j < n; ++j)
      append(feed.ptr(), PyList_GET_ITEM(out.ptr(), j));
    append_int(offsets.ptr(), PyList_GET_SIZE(feed.ptr()));
    if (f.pending.get_int(seq) != 0) {
      append(sources.ptr(), f.pending_src.get(seq).ptr());
    } else {
      append_int(sources.ptr(), -1);
    }
  }
  return py::make_tuple(sample, requests, starts, offsets, feed, sources, unguided);
}

}  // namespace

void bind_guided_walk(py::module_& m) {
  m.def("guided_columns", &guided_columns, py::arg("rows"),
        "A step's sampling rows as its guided-row snapshot reads them (engine/guided/snapshot.py guided_columns).");
}
