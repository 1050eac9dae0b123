// engine.requests._hostpath: the host's walks over a step's rows in native code, for the rows that need nothing
// else. Here: the scheduler's runs of common decode rows and the counters of a launched step; commit_walk.cpp: the
// commit of a plain step's tokens that end nothing; guided_walk.cpp: the rows a guided step's snapshot reads.
//
// engine/scheduler.py, engine/commit.py and engine/guided/snapshot.py keep each walk's definition in Python and call
// these for the rows that fit; tests hold the two equal. Fields of the engine's slots classes (Sequence,
// ScheduledRow, OutputState, SamplingParams) are read at their offsets (slots.h); a grammar's readiness is its
// GuidedRequest's `ready`.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>

#include "fields.h"
#include "py_attrs.h"
#include "slots.h"

namespace py = pybind11;
using row_fields::RowFields;
using row_fields::SeqFields;

namespace {

struct Names {
  PyObject *ready = py_attrs::intern("ready"), *take_page = py_attrs::intern("take_page");
  slots::Field wake{slots::class_of("engine.guided.closing", "Closer"), "wake"};
};

// ScheduledRow(seq, start, 1, sample, -1, 0, 0, epoch, 0): a common decode row.
py::object decode_row(py::handle row_cls, PyObject* seq, int64_t start, bool sample, py::object epoch) {
  const RowFields& r = slots::once<RowFields>();
  if (!r.direct || row_cls.ptr() != r.cls) return row_cls(py::handle(seq), start, 1, sample, -1, 0, 0, epoch);
  auto* type = reinterpret_cast<PyTypeObject*>(r.cls);
  py::object row = py::reinterpret_steal<py::object>(type->tp_alloc(type, 0));
  if (!row) throw py::error_already_set();
  PyObject* o = row.ptr();
  r.seq.set(o, seq);
  r.start.set_int(o, start);
  r.num_tokens.set_int(o, 1);
  r.sample.set(o, sample ? Py_True : Py_False);
  r.sample_idx.set_int(o, -1);
  r.spec_k.set_int(o, 0);
  r.num_drafts.set_int(o, 0);
  r.epoch.set(o, epoch.ptr());
  r.cached.set_int(o, 0);
  return row;
}

// Scheduler._schedule_running's loop from running[i] while each sequence is one it skips (nothing new to compute,
// or capped) or a common decode row (one token, within its pages or taking its next page from `blocks`, the
// BlockManager, where one is free; None: within its pages only), appending a row_cls row for each of those.
// Stops at a sequence whose closer has something to decide (Closer.hold returns False at once, and changes
// nothing, while the output is shorter than its `wake`) or at any other row, which the Python loop takes.
// -> (i, budget left).
py::tuple schedule_decode(py::list running, Py_ssize_t i, int64_t budget, int64_t page_tokens, py::list rows,
                          py::object row_cls, py::object blocks) {
  const SeqFields& f = slots::once<SeqFields>();
  const Names& k = slots::once<Names>();
  for (; i < PyList_GET_SIZE(running.ptr()) && budget > 0; ++i) {
    PyObject* seq = PyList_GET_ITEM(running.ptr(), i);
    const Py_ssize_t outputs = f.output.length(seq);
    if (py::object closer = f.closer.get(seq); !closer.is_none()) {
      if (outputs >= k.wake.get_int(closer.ptr())) break;
    }
    const int64_t scheduled = f.prompt.length(seq) + outputs + f.pending.get_int(seq);  // num_scheduled_tokens
    const int64_t computed = f.computed.get_int(seq);
    int64_t blocked = 0;
    if (py::object guided = f.guided.get(seq); !guided.is_none()) {
      blocked = !py_attrs::truth(py_attrs::attr(guided.ptr(), k.ready).ptr());  // Sequence.grammar_blocked
    }
    const int64_t n = std::min(scheduled - blocked - computed, budget);
    if (n <= 0 || scheduled >= f.max_len.get_int(seq)) continue;
    if (n != 1) break;
    if (const Py_ssize_t held = f.block_table.length(seq) * page_tokens; computed >= held) {
      // its next page, where one is free (Scheduler._reserve without a preemption); else the Python loop's
      if (blocks.is_none() || computed > held) break;
      py::object table = f.block_table.get(seq);
      if (!PyList_Check(table.ptr())) throw std::runtime_error("a block table that is not a list");
      py::object page = blocks.attr(k.take_page)();  // (after the check: a page taken is a page held)
      if (page.is_none()) break;
      py_attrs::append(table.ptr(), page.ptr());  // seq.block_table.append(page): in place
    }
    py::object row = decode_row(row_cls, seq, computed, computed + 1 == scheduled, f.preemptions.get(seq));
    py_attrs::append(rows.ptr(), row.ptr());
    --budget;
  }
  return py::make_tuple(i, budget);
}

// Scheduler.launched's counters for every row of a launched step. -> the sequences with newly full prompt pages, in
// row order, for the prefix map to register (Scheduler.launched does, after this).
py::list launched(py::list rows, bool caching, int64_t page_tokens) {
  const SeqFields& f = slots::once<SeqFields>();
  const RowFields& r = slots::once<RowFields>();
  py::list to_register;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(rows.ptr()); ++i) {
    PyObject* row = PyList_GET_ITEM(rows.ptr(), i);
    py::object seq_obj = r.seq.get(row);
    PyObject* seq = seq_obj.ptr();
    f.inflight.set_int(seq, f.inflight.get_int(seq) + 1);
    const int64_t computed = r.start.get_int(row) + r.num_tokens.get_int(row);
    f.computed.set_int(seq, computed);
    if (r.sample.truth(row)) {
      f.pending.set_int(seq, f.pending.get_int(seq) + 1 + r.spec_k.get_int(row));
      f.pending_src.set(seq, r.sample_idx.get(row).ptr());
    }
    // PrefixMap.register's own test: its full pages of prompt tokens, within its table, that are not registered
    // (pages holding outputs wait for the sequence's release or preemption: PrefixMap.release)
    if (caching && computed / page_tokens > f.registered.get_int(seq) &&
        std::min({f.prompt.length(seq), computed, f.block_table.length(seq) * page_tokens}) / page_tokens >
            f.registered.get_int(seq))
      to_register.append(seq_obj);
  }
  return to_register;
}

}  // namespace

void bind_commit_walk(py::module_& m);  // commit_walk.cpp
void bind_guided_walk(py::module_& m);  // guided_walk.cpp
void bind_publish_walk(py::module_& m);  // publish_walk.cpp

PYBIND11_MODULE(_hostpath, m) {
  m.doc() = "The host's walks over a step's rows, for the rows that need nothing else (engine/scheduler.py, "
            "engine/commit.py).";
  m.def("schedule_decode", &schedule_decode, py::arg("running"), py::arg("i"), py::arg("budget"),
        py::arg("page_tokens"), py::arg("rows"), py::arg("row_cls"), py::arg("blocks") = py::none(),
        "Common decode rows from running[i]; returns (the index the Python loop takes next, budget left).");
  m.def("launched", &launched, py::arg("rows"), py::arg("caching"), py::arg("page_tokens"),
        "A launched step's counters; returns the sequences whose full pages the prefix map registers.");
  bind_commit_walk(m);
  bind_guided_walk(m);
  bind_publish_walk(m);
}
