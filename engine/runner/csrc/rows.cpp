// engine.runner._rows: a plain step's one-token rows written into a slot's host buffers in one call.
//
// The same writes as engine/runner/rows.py's _fill_decode_py, which stays the definition (tests hold the two equal):
// the Python walk costs about a microsecond and a half a row in attribute reads and list appends, this one a few
// tenths. Any row it cannot write (a missing page, a token it cannot read, a value out of range) raises, and the
// caller runs the Python walk, which names that row.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#include "../../requests/csrc/py_attrs.h"
#include "../../requests/csrc/slots.h"

namespace py = pybind11;
using namespace py_attrs;

namespace {

constexpr Py_ssize_t kShiftWindow = 16;     // rows.py SHIFT_WINDOW

template <class T>
T* field(const py::dict& h, const char* name, size_t at_least) {
  py::object a = h[name];
  if (!py::isinstance<py::array_t<T>>(a)) throw std::invalid_argument(std::string("slot field ") + name + ": dtype");
  auto arr = py::reinterpret_borrow<py::array>(a);
  if (!arr.writeable() || !(arr.flags() & py::array::c_style) || static_cast<size_t>(arr.size()) < at_least)
    throw std::invalid_argument(std::string("slot field ") + name + ": not a writable C array of enough rows");
  return static_cast<T*>(arr.mutable_data());
}

struct Fields {
  PyObject* row_cls = slots::class_of("engine.scheduler", "ScheduledRow");
  PyObject* seq_cls = slots::class_of("engine.requests.sequence", "Sequence");
  PyObject* params_cls = slots::class_of("engine.requests.sequence", "SamplingParams");
  slots::Field seq{row_cls, "seq"}, start{row_cls, "start"}, num_tokens{row_cls, "num_tokens"},
      sample{row_cls, "sample"}, sample_idx{row_cls, "sample_idx"}, spec_k{row_cls, "spec_k"},
      num_pending{seq_cls, "num_pending"},
      pool_row{seq_cls, "pool_row"},
      block_table{seq_cls, "block_table"}, prompt{seq_cls, "prompt_token_ids"}, output{seq_cls, "output_token_ids"},
      params{seq_cls, "params"}, seed{seq_cls, "seed"}, closer{seq_cls, "closer"}, guided{seq_cls, "guided"},
      temperature{params_cls, "temperature"}, top_k{params_cls, "top_k"}, top_p{params_cls, "top_p"},
      logprobs{params_cls, "logprobs"}, penalized{params_cls, "_penalized", "penalized"};
  PyObject *token_at = intern("token_at"), *forced_at = intern("forced_at"), *seq_num_tokens = intern("num_tokens");
  PyObject* closer_cls = slots::class_of("engine.guided.closing", "Closer");
  slots::Field forced{closer_cls, "forced"}, forced_start{closer_cls, "start"};     // (after closer_cls)
};

// Closer.forced_at(index), read from its `forced` tokens and their `start` where it is a Closer (the method
// otherwise): most rows force nothing, and the call would cost more than the row's other fields.
int64_t forced_at(const Fields& k, PyObject* closer, int64_t index) {
  if (Py_IS_TYPE(closer, reinterpret_cast<PyTypeObject*>(k.closer_cls))) {
    py::object forced = k.forced.get(closer);
    if (PyList_CheckExact(forced.ptr())) {
      const Py_ssize_t n = PyList_GET_SIZE(forced.ptr());
      if (n == 0) return -1;
      const int64_t i = index - k.forced_start.get_int(closer);
      return 0 <= i && i < n ? as_int(PyList_GET_ITEM(forced.ptr(), i)) : -1;
    }
  }
  py::object f = py::reinterpret_steal<py::object>(PyObject_CallMethodOneArg(closer, k.forced_at,
                                                                            py::int_(index).ptr()));
  if (!f) throw py::error_already_set();
  return as_int(f.ptr());
}

// Sequence.token_at(i): read from its token lists where it is a Sequence (a stand-in's own method otherwise).
int64_t token_at(const Fields& k, PyObject* seq, int64_t i) {
  if (Py_IS_TYPE(seq, reinterpret_cast<PyTypeObject*>(k.seq_cls))) {
    py::object prompt = k.prompt.get(seq);
    if (PyList_CheckExact(prompt.ptr())) {
      const Py_ssize_t p = PyList_GET_SIZE(prompt.ptr());
      if (i < p) return as_int(PyList_GET_ITEM(prompt.ptr(), i));
      py::object out = k.output.get(seq);
      if (PyList_CheckExact(out.ptr()) && i - p < PyList_GET_SIZE(out.ptr()))
        return as_int(PyList_GET_ITEM(out.ptr(), i - p));
    }
  }
  py::object t = py::reinterpret_steal<py::object>(PyObject_CallMethodOneArg(seq, k.token_at, py::int_(i).ptr()));
  if (!t) throw py::error_already_set();
  return as_int(t.ptr());
}

// Sequence.num_tokens: its prompt and output lengths where it is a Sequence (a stand-in's own attribute otherwise).
int64_t num_tokens(const Fields& k, PyObject* seq) {
  if (Py_IS_TYPE(seq, reinterpret_cast<PyTypeObject*>(k.seq_cls))) return k.prompt.length(seq) + k.output.length(seq);
  return int_attr(seq, k.seq_num_tokens);
}

// A speculating engine's fields of a plain step (engine/runner/spec_rows.py fill_spec_decode, their definition).
struct SpecColumns {
  int64_t *tok_seq, *shift, *seq_shift, *kv_cap, *smp_shift, *num_drafts, *next_ids;
  SpecColumns(const py::dict& h, Py_ssize_t n)
      : tok_seq(field<int64_t>(h, "tok_seq", n)), shift(field<int64_t>(h, "shift", n)),
        seq_shift(field<int64_t>(h, "seq_shift", n)), kv_cap(field<int64_t>(h, "kv_cap", n)),
        smp_shift(field<int64_t>(h, "smp_shift", n)), num_drafts(field<int64_t>(h, "num_drafts", n)),
        next_ids(field<int64_t>(h, "next_ids", n)) {}
};

// Pages of `table` that row j of the slot's tables holds (its bt_rows entry names this very list), or -1.
int64_t held_pages(PyObject* bt_rows, Py_ssize_t j, PyObject* table, Py_ssize_t len) {
  PyObject* held = PyList_GET_ITEM(bt_rows, j);
  if (!PyTuple_Check(held) || PyTuple_GET_SIZE(held) != 2 || PyTuple_GET_ITEM(held, 0) != table) return -1;
  const int64_t have = as_int(PyTuple_GET_ITEM(held, 1));
  return have <= len ? have : -1;
}

// Row i's block table into row i of the slot's tables, only the pages it lacks if it last held this very list,
// or copied from the row up to kShiftWindow below that does (rows.py write_block_table).
void write_table(PyObject* bt_rows, Py_ssize_t i, PyObject* table, int32_t* tables, Py_ssize_t max_blocks) {
  if (!PyList_Check(table)) throw std::invalid_argument("a block table is not a list");
  const Py_ssize_t len = PyList_GET_SIZE(table);
  if (len > max_blocks) throw std::out_of_range("a block table longer than the slot's rows");
  int64_t start = held_pages(bt_rows, i, table, len);
  if (start == len) return;
  const Py_ssize_t rows = PyList_GET_SIZE(bt_rows);
  for (Py_ssize_t j = i + 1; start < 0 && j < std::min(rows, i + 1 + kShiftWindow); ++j) {
    start = held_pages(bt_rows, j, table, len);
    if (start > 0) std::copy_n(tables + j * max_blocks, start, tables + i * max_blocks);
  }
  start = std::max<int64_t>(start, 0);
  for (Py_ssize_t j = start; j < len; ++j) {
    int64_t page = as_int(PyList_GET_ITEM(table, j));
    if (page < INT32_MIN || page > INT32_MAX) throw std::out_of_range("a page id out of int32 range");
    tables[i * max_blocks + j] = static_cast<int32_t>(page);
  }
  PyObject* now = Py_BuildValue("(On)", table, len);
  if (!now) throw py::error_already_set();
  PyList_SetItem(bt_rows, i, now);  // steals `now`, drops the old tuple
}

py::tuple fill_decode(py::list rows, py::dict h, py::list bt_rows, int64_t block_size, bool spec) {
  const Fields& k = slots::once<Fields>();
  const Py_ssize_t n = PyList_GET_SIZE(rows.ptr());
  if (block_size <= 0) throw std::invalid_argument("block_size must be positive");
  if (PyList_GET_SIZE(bt_rows.ptr()) < n) throw std::invalid_argument("more rows than the slot holds");
  auto* input_ids = field<int64_t>(h, "input_ids", n);
  auto* positions = field<int64_t>(h, "positions", n);
  auto* slot_mapping = field<int64_t>(h, "slot_mapping", n);
  auto* carry_src = field<int64_t>(h, "carry_src", n);
  auto* tok_row = field<int64_t>(h, "tok_row", n);
  auto* seq_lens = field<int32_t>(h, "seq_lens", n);
  auto* cu_seqlens_q = field<int32_t>(h, "cu_seqlens_q", n + 1);
  auto* logits_indices = field<int64_t>(h, "logits_indices", n);
  auto* temperature = field<float>(h, "temperature", n);
  auto* top_k = field<int64_t>(h, "top_k", n);
  auto* top_p = field<float>(h, "top_p", n);
  auto* seeds = field<int64_t>(h, "seeds", n);
  auto* steps = field<int64_t>(h, "steps", n);
  auto* smp_row = field<int64_t>(h, "smp_row", n);
  auto* forced = field<int64_t>(h, "forced", n);
  auto tables_arr = py::reinterpret_borrow<py::array>(h["block_tables"]);
  if (!py::isinstance<py::array_t<int32_t>>(tables_arr) || tables_arr.ndim() != 2 || tables_arr.shape(0) < n ||
      !(tables_arr.flags() & py::array::c_style) || !tables_arr.writeable())
    throw std::invalid_argument("slot field block_tables: not a writable int32 (seqs, pages) C array");
  auto* tables = static_cast<int32_t*>(tables_arr.mutable_data());
  const Py_ssize_t max_blocks = tables_arr.shape(1);
  std::optional<SpecColumns> sc;
  if (spec) sc.emplace(h, n);

  Py_ssize_t s = 0, carries = 0;
  int64_t max_len = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* row = PyList_GET_ITEM(rows.ptr(), i);
    py::object seq_obj = k.seq.get(row);
    PyObject* seq = seq_obj.ptr();
    const int64_t start = k.start.get_int(row);
    const int64_t pending = k.num_pending.get_int(seq);
    const int64_t pool_row = k.pool_row.get_int(seq);
    if (pending && pool_row < 0)
      throw std::runtime_error("a sequence that carries tokens on the device holds no token-pool row");
    if (start < 0) throw std::out_of_range("a row starts before its sequence");
    py::object table = k.block_table.get(seq);
    if (!PyList_Check(table.ptr()) || start / block_size >= PyList_GET_SIZE(table.ptr()))
      throw std::out_of_range("a row's page is missing from its block table");
    const int64_t page = as_int(PyList_GET_ITEM(table.ptr(), start / block_size));
    const int64_t token = pending ? 0 : token_at(k, seq, start);
    write_table(bt_rows.ptr(), i, table.ptr(), tables, max_blocks);
    input_ids[i] = token;
    positions[i] = start;
    slot_mapping[i] = page * block_size + start % block_size;
    carry_src[i] = pending ? 0 : -1;
    tok_row[i] = pool_row;
    if (start + 1 > INT32_MAX) throw std::out_of_range("a sequence longer than int32");
    seq_lens[i] = static_cast<int32_t>(start + 1);
    cu_seqlens_q[i + 1] = static_cast<int32_t>(i + 1);
    carries += pending == 0 ? 0 : 1;
    max_len = std::max(max_len, start + 1);
    if (sc) {
      sc->tok_seq[i] = i;
      sc->shift[i] = pending > 0;
      sc->seq_shift[i] = pending > 0 ? pool_row : -1;
      sc->kv_cap[i] = PyList_GET_SIZE(table.ptr()) * block_size;
    }
    if (!k.sample.truth(row)) {
      if (sc) sc->next_ids[i] = start + 1 < num_tokens(k, seq) ? token_at(k, seq, start + 1) : -1;
      continue;
    }
    if (sc) {
      sc->smp_shift[s] = pending > 0;
      sc->num_drafts[s] = 0;
      sc->next_ids[i] = -2 - s;
    }
    k.sample_idx.set_int(row, s);
    py::object params = k.params.get(seq);
    const int64_t step = k.output.length(seq) + pending;
    py::object closer = k.closer.get(seq);
    const int64_t force = closer.is_none() ? -1 : forced_at(k, closer.ptr(), step);
    logits_indices[s] = i;
    temperature[s] = static_cast<float>(as_float(k.temperature.get(params.ptr()).ptr()));
    top_k[s] = k.top_k.get_int(params.ptr());
    top_p[s] = static_cast<float>(as_float(k.top_p.get(params.ptr()).ptr()));
    seeds[s] = k.seed.get_int(seq);
    steps[s] = step;
    smp_row[s] = pool_row;
    forced[s] = force;
    ++s;
  }
  return py::make_tuple(n, s, n ? 1 : 0, max_len, carries);
}

// Tokens [start, known) of a sequence into out[0, known - start): from its token lists where it is a Sequence.
void copy_tokens(const Fields& k, PyObject* seq, int64_t start, int64_t known, int64_t* out) {
  if (!Py_IS_TYPE(seq, reinterpret_cast<PyTypeObject*>(k.seq_cls))) {
    for (int64_t p = start; p < known; ++p) out[p - start] = token_at(k, seq, p);
    return;
  }
  py::object prompt = k.prompt.get(seq), output = k.output.get(seq);
  if (!PyList_CheckExact(prompt.ptr()) || !PyList_CheckExact(output.ptr()))
    throw std::invalid_argument("a sequence's tokens are not lists");
  const Py_ssize_t plen = PyList_GET_SIZE(prompt.ptr());
  if (known > plen + PyList_GET_SIZE(output.ptr())) throw std::out_of_range("a token past the sequence's end");
  for (int64_t p = start; p < known; ++p)
    out[p - start] = as_int(p < plen ? PyList_GET_ITEM(prompt.ptr(), p) : PyList_GET_ITEM(output.ptr(), p - plen));
}

// rows.py fill_tokens (its definition): a row's tokens from index t of the step, in one call (a prompt chunk's
// tokens take a Python step each there).
void fill_tokens(py::handle row, py::dict h, int64_t t, int64_t block_size) {
  const Fields& k = slots::once<Fields>();
  PyObject* r = row.ptr();
  py::object seq_obj = k.seq.get(r);
  PyObject* seq = seq_obj.ptr();
  const int64_t n = k.num_tokens.get_int(r), start = k.start.get_int(r), drafts = k.spec_k.get_int(r);
  if (block_size <= 0 || t < 0 || n < 1 || start < 0) throw std::invalid_argument("a row out of range");
  if (drafts && drafts != n - 1) throw std::invalid_argument("a speculating row holds its last token and K drafts");
  const int64_t end = start + n, known = std::min(end, num_tokens(k, seq)), pool_row = k.pool_row.get_int(seq);
  auto* positions = field<int64_t>(h, "positions", t + n);
  auto* slot_mapping = field<int64_t>(h, "slot_mapping", t + n);
  auto* tok_row = field<int64_t>(h, "tok_row", t + n);
  auto* carry_src = field<int64_t>(h, "carry_src", t + n);
  auto* input_ids = field<int64_t>(h, "input_ids", t + n);
  py::object table = k.block_table.get(seq);
  if (!PyList_Check(table.ptr()) || (end - 1) / block_size >= PyList_GET_SIZE(table.ptr()))
    throw std::out_of_range("a row's page is missing from its block table");
  for (int64_t p = start; p < end; ++p) {
    const int64_t i = t + p - start;
    positions[i] = p;
    slot_mapping[i] = as_int(PyList_GET_ITEM(table.ptr(), p / block_size)) * block_size + p % block_size;
    tok_row[i] = pool_row;
    carry_src[i] = -1;
  }
  if (known > start) copy_tokens(k, seq, start, known, input_ids + t);
  for (int64_t d = 1; d <= drafts; ++d) {       // [last token, K drafts]
    carry_src[t + d] = d;
    input_ids[t + d] = 0;
  }
  if (k.num_pending.get_int(seq)) {            // its last token is still on the device
    const int64_t last = drafts ? t : t + n - 1;
    input_ids[last] = 0;
    carry_src[last] = 0;
  }
}

// rows.py's ROW_* bits over a step's rows (row_flags_py, their definition): which variant and which host work the
// step needs.
int64_t row_flags(py::list rows) {
  const Fields& k = slots::once<Fields>();
  int64_t flags = 0;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(rows.ptr()); ++i) {
    PyObject* row = PyList_GET_ITEM(rows.ptr(), i);
    py::object seq = k.seq.get(row);
    py::object params = k.params.get(seq.ptr());
    flags |= k.penalized.truth(params.ptr()) ? 2 : 0;
    if (!k.sample.truth(row)) continue;
    flags |= k.logprobs.is_none(params.ptr()) ? 0 : 1;
    flags |= as_float(k.temperature.get(params.ptr()).ptr()) != 0.0 ? 4 : 0;
    flags |= k.guided.is_none(seq.ptr()) ? 0 : 8;
  }
  return flags;
}

// How many of a step's first rows compute one token each (rows.py _fill's leading decode rows).
Py_ssize_t leading_decode(py::list rows) {
  const Fields& k = slots::once<Fields>();
  Py_ssize_t i = 0;
  while (i < PyList_GET_SIZE(rows.ptr()) && k.num_tokens.get_int(PyList_GET_ITEM(rows.ptr(), i)) == 1) ++i;
  return i;
}

}  // namespace

PYBIND11_MODULE(_rows, m) {
  m.doc() = "A plain step's one-token rows written into a slot's host buffers (engine/runner/rows.py).";
  m.def("fill_decode", &fill_decode, py::arg("rows"), py::arg("h"), py::arg("bt_rows"), py::arg("block_size"),
        py::arg("spec") = false,
        "Write the rows' inputs and sampling fields (with `spec`, a speculating engine's too); returns (tokens, "
        "sampling rows, 1, longest sequence, carrying rows). Raises on a row it cannot write, having written some "
        "rows.");
  m.def("fill_tokens", &fill_tokens, py::arg("row"), py::arg("h"), py::arg("t"), py::arg("block_size"),
        "rows.py fill_tokens: a row's positions, slot mapping, ids, pool rows and carry sources from index t.");
  m.def("leading_decode", &leading_decode, py::arg("rows"), "How many first rows compute one token each.");
  m.def("row_flags", &row_flags, py::arg("rows"), "rows.py's ROW_* bits of a step's rows.");
}
