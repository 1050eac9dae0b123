// engine.guided._native's llguidance part: tokenizer, compiled grammar and row matcher (engine/guided/llg.py).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "llg.h"

namespace py = pybind11;
using namespace grammar_node;

namespace {

bool checked(const Call& c) {  // the Python path's view: an llguidance failure raises
  if (!c.ok) {
    std::string text = c.error;
    for (const char* kind : {"RuntimeError: ", "ValueError: "})
      if (text.rfind(kind, 0) == 0) text = text.substr(std::string(kind).size());
    throw std::runtime_error(text);
  }
  return c.value;
}

}  // namespace

void bind_llg(py::module_& m) {
  py::class_<LlgApi, std::shared_ptr<LlgApi>>(m, "LlgApi");
  m.def("llg_api", [](const std::string& lib) { return std::const_pointer_cast<LlgApi>(load_llg(lib)); },
        py::arg("lib"), "Resolve llguidance's C API in `lib` (its Python extension), once per process.");

  py::class_<LlgTokenizer, std::shared_ptr<LlgTokenizer>>(m, "LlgTokenizer")
      .def(py::init([](std::shared_ptr<LlgApi> api, const std::vector<py::bytes>& tokens, std::vector<uint32_t> eos) {
             std::vector<std::string> bytes(tokens.begin(), tokens.end());
             return std::make_shared<LlgTokenizer>(std::move(api), bytes, eos);
           }), py::arg("api"), py::arg("tokens"), py::arg("eos"))
      .def_readonly("vocab_size", &LlgTokenizer::vocab_size)
      .def("decode", [](const LlgTokenizer& t, const std::vector<uint32_t>& tokens, bool special) {
             return py::bytes(t.decode(tokens, special));
           }, py::arg("tokens"), py::arg("special") = false, "The tokens' bytes (special ones only if `special`).");

  py::class_<LlgGrammar, std::shared_ptr<LlgGrammar>>(m, "LlgGrammar")
      .def(py::init([](std::shared_ptr<LlgTokenizer> tok, const std::string& grammar) {
             return std::make_shared<LlgGrammar>(std::move(tok), grammar);
           }), py::arg("tokenizer"), py::arg("grammar"), py::call_guard<py::gil_scoped_release>())
      .def("matcher", &LlgGrammar::matcher);

  py::class_<LlgRowMatcher, std::shared_ptr<LlgRowMatcher>>(m, "LlgMatcher")
      .def("accept_token", [](LlgRowMatcher& r, int64_t t) { return checked(r.accept_token(t)); }, py::arg("token"))
      .def("is_terminated", &LlgRowMatcher::is_terminated)
      .def("rollback", [](LlgRowMatcher& r, int64_t n) { checked(r.rollback(n)); }, py::arg("n"))
      .def("fill", [](LlgRowMatcher& r, uintptr_t row, int64_t words) {
             Call c;
             {
               py::gil_scoped_release released;
               c = r.fill(reinterpret_cast<int32_t*>(row), words);
             }
             checked(c);
           }, py::arg("row"), py::arg("words"), "Fill one mask row of `words` int32 words at address `row`.");
}
