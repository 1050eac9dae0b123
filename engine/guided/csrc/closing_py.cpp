// engine.guided._native's closing search (engine/guided/closing.py calls it for xgrammar's own matchers).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "closing.h"

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

}  // namespace

void bind_closing(py::module_& m) {
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
