// engine/commit.py's walk over a plain step's rows in native code, for the commits that end nothing: each row's
// token appended, its closer told, its output made. Commits.step keeps the walk's definition in Python and calls
// this for the rows that fit; tests hold the two equal. Fields of OutputState and Closer are read at their slots'
// offsets (slots.h) or by name.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "../../guided/csrc/repetition.h"
#include "fields.h"
#include "guided_state.h"
#include "py_attrs.h"
#include "slots.h"

namespace py = pybind11;
using row_fields::RowFields;
using row_fields::SeqFields;
using slots::Field;

namespace {

struct OutFields {
  PyObject* cls = slots::class_of("engine.requests.output", "OutputState");
  Field reason{cls, "reason"}, lazy{cls, "lazy"}, detok{cls, "detok"}, num_new{cls, "num_new"};
};

// Closer's fields that decide whether Closer.committed(seq, 1) changes anything (a slots class: at their offsets).
struct CloserFields {
  PyObject* cls = slots::class_of("engine.guided.closing", "Closer");
  int64_t max_period = py::module_::import("engine.guided.closing").attr("MAX_PERIOD").cast<int64_t>();
  Field guard_limit{cls, "guard_limit"}, repeating{cls, "repeating"}, forced{cls, "forced"}, quiet{cls, "quiet"},
      runs{cls, "runs"}, watch{cls, "watch"}, watch_from{cls, "watch_from"}, wake{cls, "wake"};
};

// Whether `obj` is an exact int that fits a long long (its value in `value`); false leaves no Python error set
bool exact_int(PyObject* obj, long long& value) {
  if (!PyLong_CheckExact(obj)) return false;
  int overflow = 0;
  value = PyLong_AsLongLongAndOverflow(obj, &overflow);
  if (!overflow && !(value == -1 && PyErr_Occurred())) return true;
  PyErr_Clear();
  return false;
}

// Whether list item `item` equals `token` (an exact int: compared as a C value; anything else as Python compares)
bool same_token(PyObject* item, PyObject* token, long long value, bool exact) {
  if (item == token) return true;
  long long v = 0;
  if (exact && exact_int(item, v)) return v == value;
  const int eq = PyObject_RichCompareBool(item, token, Py_EQ);
  if (eq < 0) throw py::error_already_set();
  return eq;
}

struct CommitNames {
  PyObject *error = py_attrs::intern("error"), *committed = py_attrs::intern("committed");
  Field stop_token_ids{slots::class_of("engine.requests.sequence", "SamplingParams"), "stop_token_ids"};
};

// RequestOutput(request_id, new_token_ids, new_text, finished) with every other field at its default, built as the
// tuple it is (a namedtuple: a tuple subclass of fixed fields).
struct OutputMaker {
  PyTypeObject* cls = reinterpret_cast<PyTypeObject*>(slots::class_of("engine.requests.output", "RequestOutput"));
  py::tuple defaults;
  PyObject* empty = py_attrs::intern("");

  OutputMaker() {
    py::object type = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(cls));
    py::tuple fields = type.attr("_fields");
    py::dict given = type.attr("_field_defaults");
    const char* first[] = {"request_id", "new_token_ids", "new_text", "finished"};
    for (int j = 0; j < 4; ++j)
      if (fields[j].cast<std::string>() != first[j]) throw std::runtime_error("RequestOutput's fields changed");
    defaults = py::tuple(py::len(fields));
    for (size_t j = 0; j < py::len(fields); ++j) defaults[j] = j < 4 ? py::none() : py::object(given[fields[j]]);
  }

  py::object make(PyObject* request_id, PyObject* token) const {
    py::tuple ids = py::make_tuple(py::reinterpret_borrow<py::object>(token));
    const Py_ssize_t n = PyTuple_GET_SIZE(defaults.ptr());
    PyObject* out = cls->tp_alloc(cls, n);
    if (!out) throw py::error_already_set();
    PyObject* items[] = {request_id, ids.ptr(), empty, Py_False};
    for (Py_ssize_t j = 0; j < n; ++j) {
      PyObject* v = j < 4 ? items[j] : PyTuple_GET_ITEM(defaults.ptr(), j);
      Py_INCREF(v);
      PyTuple_SET_ITEM(out, j, v);
    }
    return py::reinterpret_steal<py::object>(out);
  }
};

// Whether Closer.committed(seq, 1) would return at once: its guard is off, the value is already closing, or the
// one new token (the last of `ids`) repeats none of the MAX_PERIOD before it while no run is going. Where this is
// not a Closer, or not known, false: the caller makes the call.
bool commit_changes_nothing(PyObject* closer, PyObject* ids) {
  const CloserFields& c = slots::once<CloserFields>();
  if (!Py_IS_TYPE(closer, reinterpret_cast<PyTypeObject*>(c.cls)) || !PyList_CheckExact(ids)) return false;
  if (!c.guard_limit.truth(closer) || c.repeating.truth(closer) || c.forced.truth(closer)) return true;
  if (!c.quiet.truth(closer)) return false;
  const Py_ssize_t n = PyList_GET_SIZE(ids);
  if (n == 0) return false;
  PyObject* last = PyList_GET_ITEM(ids, n - 1);
  long long value = 0;
  const bool exact = PyLong_CheckExact(last);
  if (exact && !exact_int(last, value)) return false;    // too large for a C value: the call decides
  for (Py_ssize_t j = std::max<Py_ssize_t>(0, n - 1 - c.max_period); j < n - 1; ++j)
    if (same_token(PyList_GET_ITEM(ids, j), last, value, exact)) return false;
  return true;
}

// Closer.committed(seq, 1) of a closer whose new token commit_changes_nothing could not rule out, the same steps
// in native code: the repetition guard's scan of that token (repetition.h) and the fields it sets. False where
// this is not a Closer the walk knows, or its fields are not as closing.py writes them: the caller makes the call.
bool native_committed(PyObject* closer, PyObject* ids) {
  const CloserFields& c = slots::once<CloserFields>();
  if (!Py_IS_TYPE(closer, reinterpret_cast<PyTypeObject*>(c.cls)) || !PyList_CheckExact(ids)) return false;
  py::object runs = c.runs.get(closer);
  const size_t periods = static_cast<size_t>(c.max_period);
  if (!PyList_CheckExact(runs.ptr()) || PyList_GET_SIZE(runs.ptr()) != c.max_period + 1) return false;
  const size_t n = static_cast<size_t>(PyList_GET_SIZE(ids));
  if (n == 0) return false;
  long tok[64], run[64];
  if (periods + 1 > 64) return false;
  const size_t from = n - 1 > periods ? n - 1 - periods : 0;   // the scan reads tok[n - 1 - periods ..]
  for (size_t i = from; i < n; ++i) tok[i - from] = static_cast<long>(py_attrs::as_int(PyList_GET_ITEM(ids, i)));
  for (size_t p = 0; p <= periods; ++p) run[p] = static_cast<long>(py_attrs::as_int(PyList_GET_ITEM(runs.ptr(), p)));
  const long limit = static_cast<long>(c.guard_limit.get_int(closer));
  const long watch_from = static_cast<long>(c.watch_from.get_int(closer));
  const bool watch = c.watch.truth(closer);
  long before[64];
  std::copy(run, run + periods + 1, before);
  const int state = repetition::scan(tok, n - from, n - 1 - from, run, periods, limit, watch_from, watch);
  for (size_t p = 0; p <= periods; ++p) {
    if (run[p] == before[p]) continue;  // (the list keeps its int)
    PyObject* v = PyLong_FromLong(run[p]);
    if (!v) throw py::error_already_set();
    PyList_SetItem(runs.ptr(), static_cast<Py_ssize_t>(p), v);
  }
  py::object zero = py::int_(0);
  if (state & repetition::FIRED) {
    c.repeating.set(closer, Py_True);
    c.watch.set(closer, Py_False);
    c.wake.set(closer, zero.ptr());
    return true;
  }
  const bool watching = state & repetition::WATCH;
  bool any_run = false;
  for (size_t p = 0; p <= periods; ++p) any_run = any_run || run[p];
  c.watch.set(closer, watching ? Py_True : Py_False);
  c.quiet.set(closer, !watching && !any_run ? Py_True : Py_False);
  if (state & repetition::WOKE) c.wake.set(closer, zero.ptr());
  return true;
}

// Closer.committed(seq, 1) done here where it changes nothing or native_committed can take it; false where it
// cannot tell (the call then decides, and fails the row if it raises)
bool quiet_commit(PyObject* closer, PyObject* ids) {
  try {
    return commit_changes_nothing(closer, ids) || native_committed(closer, ids);
  } catch (py::error_already_set&) {
    return false;
  }
}

// Whether a plain step's sampling row commits here: OutputProcessor.commit_plain's case (one token that ends
// nothing, for a request whose text is not streamed and that wants no logprobs), of a request whose grammar did
// not fail. Reads only.
bool plain_commit(PyObject* seq, PyObject* token, bool guided_failure, PyObject* eos_ids) {
  const SeqFields& f = slots::once<SeqFields>();
  const OutFields& o = slots::once<OutFields>();
  const CommitNames& k = slots::once<CommitNames>();
  if (py::object guided = f.guided.get(seq); py_attrs::truth(guided.ptr())) {
    if (guided_failure) return false;
    const grammar_node::RowState* state = guided_state::of(guided.ptr());   // (no error: failed() is false)
    if ((!state || state->failed()) && py_attrs::truth(py_attrs::attr(guided.ptr(), k.error).ptr())) return false;
  }
  py::object st = f.out.get(seq);
  if (st.is_none() || !o.reason.is_none(st.ptr()) || !(o.lazy.truth(st.ptr()) || o.detok.is_none(st.ptr())) ||
      !f.logprobs.is_none(seq) || !PyLong_CheckExact(token) || py_attrs::as_int(token) < 0)
    return false;
  int in = PySet_Contains(eos_ids, token);
  if (in != 0) {
    if (in < 0) throw py::error_already_set();
    return false;
  }
  py::object stops = k.stop_token_ids.get(f.params.get(seq).ptr());
  if (!PyTuple_CheckExact(stops.ptr()) || PyTuple_GET_SIZE(stops.ptr()) > 0) {
    in = PySequence_Contains(stops.ptr(), token);
    if (in != 0) {
      if (in < 0) throw py::error_already_set();
      return false;
    }
  }
  return f.prompt.length(seq) + f.output.length(seq) + 1 < f.max_len.get_int(seq);
}

// Commits.step's loop over a plain step's rows from rows[i] while each is a row that does not sample (it stops
// holding its sequence: Scheduler.landed) or a sampling row that plain_commit takes: landed, its token appended,
// its closer told, its output appended to `outputs`. A closer that raises fails its request through on_error(seq,
// exception) -> output, as the Python loop does. Stops, having changed nothing of it, at a row of a finished
// sequence (a zombie), any other commit, or a row whose fields cannot be read, which the Python loop takes (and
// fails alone). -> the index the Python loop takes next.
Py_ssize_t commit_plain(py::list rows, Py_ssize_t i, py::list tokens, bool guided_failure, py::object now,
                        py::object eos_ids, py::list outputs, py::object on_error) {
  const SeqFields& f = slots::once<SeqFields>();
  const RowFields& r = slots::once<RowFields>();
  const OutFields& o = slots::once<OutFields>();
  const CommitNames& k = slots::once<CommitNames>();
  if (!PyFrozenSet_Check(eos_ids.ptr())) throw py::type_error("eos_ids must be a frozenset");
  py::int_ one(1);
  for (; i < PyList_GET_SIZE(rows.ptr()); ++i) {
    PyObject* row = PyList_GET_ITEM(rows.ptr(), i);
    py::object seq_obj = r.seq.get(row);
    PyObject* seq = seq_obj.ptr();
    if (f.finalized.truth(seq)) break;
    if (!r.sample.truth(row)) {
      f.inflight.set_int(seq, f.inflight.get_int(seq) - 1);
      continue;
    }
    const int64_t idx = r.sample_idx.get_int(row);
    if (r.spec_k.get_int(row) != 0 || idx < 0 || idx >= PyList_GET_SIZE(tokens.ptr())) break;
    PyObject* token = PyList_GET_ITEM(tokens.ptr(), idx);
    try {
      if (!plain_commit(seq, token, guided_failure, eos_ids.ptr())) break;
    } catch (py::error_already_set&) {  // a row that cannot be read: the Python loop fails it alone
      break;
    }
    f.inflight.set_int(seq, f.inflight.get_int(seq) - 1);
    f.pending.set_int(seq, f.pending.get_int(seq) - 1);
    py::object ids = f.output.get(seq);
    py_attrs::append(ids.ptr(), token);
    o.num_new.set(f.out.get(seq).ptr(), one.ptr());
    py::object out = slots::once<OutputMaker>().make(f.seq_id.get(seq).ptr(), token);
    if (py::object closer = f.closer.get(seq); !closer.is_none() && !quiet_commit(closer.ptr(), ids.ptr())) {
      PyObject* res = PyObject_CallMethodObjArgs(closer.ptr(), k.committed, seq, one.ptr(), nullptr);
      if (!res) {
        py::error_already_set exc;
        out = on_error(seq_obj, exc.value());
        py_attrs::append(outputs.ptr(), out.ptr());
        continue;
      }
      Py_DECREF(res);
    }
    if (f.first_token_time.is_none(seq)) f.first_token_time.set(seq, now.ptr());
    py_attrs::append(outputs.ptr(), out.ptr());
  }
  return i;
}

}  // namespace

void bind_commit_walk(py::module_& m) {
  m.def("commit_plain", &commit_plain, py::arg("rows"), py::arg("i"), py::arg("tokens"), py::arg("guided_failure"),
        py::arg("now"), py::arg("eos_ids"), py::arg("outputs"), py::arg("on_error"),
        "A plain step's common commits from rows[i]; returns the index the Python loop takes next.");
  m.def("closer_committed", [](py::object closer, py::object ids) { return quiet_commit(closer.ptr(), ids.ptr()); },
        py::arg("closer"), py::arg("ids"),
        "Closer.committed(seq, 1) as the native commit takes it (seq's output `ids`, its last token new): True "
        "where done here, False where the commit calls it.");
}
