// The fields of Sequence and ScheduledRow that the host path's walks read and write at their slots' offsets
// (slots.h), one definition for every file of engine.requests._hostpath.
#pragma once

#include <pybind11/pybind11.h>

#include "slots.h"

namespace row_fields {

namespace py = pybind11;
using slots::Field;

struct SeqFields {
  PyObject* cls = slots::class_of("engine.requests.sequence", "Sequence");
  Field prompt{cls, "prompt_token_ids"}, output{cls, "output_token_ids"}, pending{cls, "num_pending"},
      computed{cls, "num_computed_tokens"}, guided{cls, "guided"}, max_len{cls, "max_len"}, closer{cls, "closer"},
      block_table{cls, "block_table"}, preemptions{cls, "num_preemptions"}, inflight{cls, "inflight_refs"},
      pending_src{cls, "pending_src"}, registered{cls, "num_registered"}, finalized{cls, "finalized"},
      out{cls, "out"}, logprobs{cls, "logprobs"}, params{cls, "params"}, seq_id{cls, "seq_id"},
      first_token_time{cls, "first_token_time"};
};

struct RowFields {
  PyObject* cls = slots::class_of("engine.scheduler", "ScheduledRow");
  Field seq{cls, "seq"}, start{cls, "start"}, num_tokens{cls, "num_tokens"}, sample{cls, "sample"},
      sample_idx{cls, "sample_idx"}, spec_k{cls, "spec_k"}, num_drafts{cls, "num_drafts"}, epoch{cls, "epoch"},
      cached{cls, "cached"};
  // a new row by its slots, not through the dataclass's Python __init__; needs every field a slot
  bool direct = seq.direct() && start.direct() && num_tokens.direct() && sample.direct() && sample_idx.direct() &&
                spec_k.direct() && num_drafts.direct() && epoch.direct() && cached.direct() && slot_count() == 9;

  Py_ssize_t slot_count() const {
    py::object names = py::reinterpret_borrow<py::object>(cls).attr("__slots__");
    return py::len(names);
  }
};

}  // namespace row_fields
