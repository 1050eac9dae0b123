// engine.requests._hostpath: the scheduler's walk over running sequences, for runs of common decode rows.
//
// engine/scheduler.py keeps the definition in Python and calls this for the rows that need nothing else. It reads
// the same Sequence attributes the Python would, in the same order; a grammar's readiness is
// Sequence.grammar_blocked's part, its GuidedRequest's `ready`. (A launched step's counters stay in Python: there,
// attribute writes through the C API cost more than the interpreter's own.)
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "py_attrs.h"

namespace py = pybind11;
using namespace py_attrs;

namespace {

struct Names {
  PyObject *prompt_token_ids, *output_token_ids, *num_pending, *num_computed_tokens, *guided, *ready,
      *max_len, *closer, *block_table, *num_preemptions, *wake;
  Names() {
    for (auto [slot, text] : {std::pair{&prompt_token_ids, "prompt_token_ids"},
                              {&output_token_ids, "output_token_ids"}, {&num_pending, "num_pending"},
                              {&num_computed_tokens, "num_computed_tokens"}, {&guided, "guided"},
                              {&ready, "ready"}, {&max_len, "max_len"}, {&closer, "closer"},
                              {&block_table, "block_table"}, {&num_preemptions, "num_preemptions"},
                              {&wake, "wake"}}) {
      *slot = intern(text);
    }
  }
};

const Names& names() {
  static const Names k;
  return k;
}

// Scheduler._schedule_running's loop from running[i] while each sequence is one it skips (nothing new to compute,
// or capped) or a common decode row (one token, within its pages), appending a row_cls row for each of those.
// Stops at a sequence whose closer has something to decide (Closer.hold returns False at once, and changes
// nothing, while the output is shorter than its `wake`) or at any other row, which the Python loop takes.
// -> (i, budget left).
py::tuple schedule_decode(py::list running, Py_ssize_t i, int64_t budget, int64_t page_tokens, py::list rows,
                          py::object row_cls) {
  const Names& k = names();
  for (; i < PyList_GET_SIZE(running.ptr()) && budget > 0; ++i) {
    PyObject* seq = PyList_GET_ITEM(running.ptr(), i);
    py::object closer = attr(seq, k.closer);
    if (!closer.is_none() && len_attr(seq, k.output_token_ids) >= int_attr(closer.ptr(), k.wake)) break;
    const int64_t scheduled = len_attr(seq, k.prompt_token_ids) + len_attr(seq, k.output_token_ids) +
                              int_attr(seq, k.num_pending);  // Sequence.num_scheduled_tokens
    const int64_t computed = int_attr(seq, k.num_computed_tokens);
    int64_t blocked = 0;
    if (py::object guided = attr(seq, k.guided); !guided.is_none()) {
      blocked = !truth(attr(guided.ptr(), k.ready).ptr());  // Sequence.grammar_blocked
    }
    const int64_t n = std::min(scheduled - blocked - computed, budget);
    if (n <= 0 || scheduled >= int_attr(seq, k.max_len)) continue;
    if (n != 1 || computed >= len_attr(seq, k.block_table) * page_tokens) break;
    py::object row = row_cls(py::handle(seq), computed, 1, computed + 1 == scheduled, -1, 0, 0,
                             attr(seq, k.num_preemptions));
    if (PyList_Append(rows.ptr(), row.ptr()) < 0) throw py::error_already_set();
    --budget;
  }
  return py::make_tuple(i, budget);
}

}  // namespace

PYBIND11_MODULE(_hostpath, m) {
  m.doc() = "The scheduler's walk over runs of common decode rows (engine/scheduler.py).";
  m.def("schedule_decode", &schedule_decode, py::arg("running"), py::arg("i"), py::arg("budget"),
        py::arg("page_tokens"), py::arg("rows"), py::arg("row_cls"),
        "Common decode rows from running[i]; returns (the index the Python loop takes next, budget left).");
}
