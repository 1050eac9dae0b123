// engine.guided._native's closing search (engine/guided/closing.py calls it for xgrammar's own matchers).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "closing.h"
#include "closing_vocab.h"
#include "repetition.h"

namespace py = pybind11;
using namespace grammar_node;

namespace {

std::shared_ptr<const ClosingSearch> make_search(const std::string& lib, uintptr_t accept_string, uintptr_t jump,
                                                 uintptr_t is_completed, uintptr_t rollback,
                                                 std::vector<std::string> candidates, std::vector<std::string> branches,
                                                 std::string closers, size_t branch_points) {
  auto s = std::make_shared<ClosingSearch>();
  s->api = load_ffi(lib);
  if (!s->api.error.empty()) throw std::runtime_error("closing search: " + s->api.error);
  s->accept_string = reinterpret_cast<void*>(accept_string);
  s->find_jump_forward_string = reinterpret_cast<void*>(jump);
  s->is_completed = reinterpret_cast<void*>(is_completed);
  s->rollback = reinterpret_cast<void*>(rollback);
  for (void* f : {s->accept_string, s->find_jump_forward_string, s->is_completed, s->rollback}) {
    if (!f) throw std::invalid_argument("closing search: a matcher method handle is null");
    s->api.object_inc_ref(f);  // held for the process
  }
  for (const auto& list : {candidates, branches})
    for (const std::string& b : list)
      if (b.empty() || b.find('\0') != std::string::npos)
        throw std::invalid_argument("closing search: a candidate or branch is empty or holds a NUL byte");
  if (branches.empty()) throw std::invalid_argument("closing search: no branches");
  s->candidates = std::move(candidates);
  s->branches = std::move(branches);
  s->closers = std::move(closers);
  s->branch_points = branch_points;
  return s;
}

void* matcher_of(uintptr_t handle) {
  if (!handle) throw std::invalid_argument("closing search: a null matcher handle");
  return reinterpret_cast<void*>(handle);
}

// closing.py's repetition_scan_py, over the output's tokens from `start`: `runs` (MAX_PERIOD + 1 ints) updated in
// place (repetition.h).
int repetition_scan(py::list out, size_t start, py::list runs, long limit, long watch_from, bool watch) {
  const size_t n = out.size(), periods = runs.size() - 1;
  if (runs.size() < 2) throw std::invalid_argument("repetition_scan: runs needs a slot per period and one more");
  std::vector<long> tok(n), run(periods + 1);
  const size_t from = start > periods ? start - periods : 0;
  for (size_t i = from; i < n; ++i) tok[i] = PyLong_AsLong(PyList_GET_ITEM(out.ptr(), i));
  for (size_t p = 0; p <= periods; ++p) run[p] = PyLong_AsLong(PyList_GET_ITEM(runs.ptr(), p));
  if (PyErr_Occurred()) throw py::error_already_set();
  const int result = repetition::scan(tok.data(), n, start, run.data(), periods, limit, watch_from, watch);
  for (size_t p = 0; p <= periods; ++p) PyList_SetItem(runs.ptr(), p, PyLong_FromLong(run[p]));
  return result;
}

}  // namespace

void bind_closing(py::module_& m) {
  m.attr("REPEAT_FIRED") = repetition::FIRED;
  m.attr("REPEAT_WATCH") = repetition::WATCH;
  m.attr("REPEAT_WOKE") = repetition::WOKE;
  py::class_<ClosingVocab, std::shared_ptr<ClosingVocab>>(m, "ClosingVocab")
      .def(py::init([](const std::vector<py::bytes>& pieces, const std::vector<int64_t>& ids) {
             std::vector<std::string> text(pieces.begin(), pieces.end());
             return std::make_shared<ClosingVocab>(text, ids);
           }), py::arg("pieces"), py::arg("ids"))
      .def("tokens", [](const ClosingVocab& v, py::bytes text) { return v.tokens(std::string(text)); },
           py::arg("text"), "Longest-match tokens of `text` (ValueError where no token spells a byte).");
  m.def("repetition_scan", &repetition_scan, py::arg("out"), py::arg("start"), py::arg("runs"), py::arg("limit"),
        py::arg("watch_from"), py::arg("watch"), "closing.py's repetition_scan_py in one call.");
  py::class_<ClosingSearch, std::shared_ptr<ClosingSearch>>(m, "ClosingSearch");
  m.def("closing_search", &make_search, py::arg("lib"), py::arg("accept_string"),
        py::arg("find_jump_forward_string"), py::arg("is_completed"), py::arg("rollback"), py::arg("candidates"),
        py::arg("branches"), py::arg("closers"), py::arg("branch_points"),
        "Bind libtvm_ffi, xgrammar's GrammarMatcher methods the search calls, and its constants.");
  m.def("closing_text", [](const ClosingSearch& s, uintptr_t handle, size_t limit) -> std::optional<py::bytes> {
          std::optional<std::string> text = closing_text(s, matcher_of(handle), limit);
          if (!text) return std::nullopt;
          return py::bytes(*text);
        }, py::arg("search"), py::arg("matcher"), py::arg("limit"),
        "closing.py's closing_text on the matcher whose tvm-ffi handle is given.");
  m.def("branch_closings", [](const ClosingSearch& s, uintptr_t handle, const std::string& text, size_t limit) {
          std::vector<py::bytes> out;
          for (std::string& t : branch_closings(s, matcher_of(handle), text, limit)) out.emplace_back(t);
          return out;
        }, py::arg("search"), py::arg("matcher"), py::arg("text"), py::arg("limit"),
        "closing.py's branch_closings on the matcher whose tvm-ffi handle is given.");
}
