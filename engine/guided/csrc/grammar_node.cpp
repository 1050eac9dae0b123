// engine.guided._native: the grammar node's Python surface (engine/guided/native.py wraps it).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "node.h"
#include "registry.h"

namespace py = pybind11;
using namespace grammar_node;

void bind_llg(py::module_& m);      // llg_py.cpp
void bind_closing(py::module_& m);  // closing_py.cpp

namespace {

std::shared_ptr<const Matchers> make_matchers(const std::string& lib, uintptr_t accept, uintptr_t fill,
                                              uintptr_t roll, uintptr_t terminated) {
  auto m = std::make_shared<Matchers>();
  m->api = load_ffi(lib);
  if (!m->api.error.empty()) throw std::runtime_error("grammar node: " + m->api.error);
  m->accept_token = reinterpret_cast<void*>(accept);
  m->fill_next_token_bitmask = reinterpret_cast<void*>(fill);
  m->rollback = reinterpret_cast<void*>(roll);
  m->is_terminated = reinterpret_cast<void*>(terminated);
  for (void* f : {m->accept_token, m->fill_next_token_bitmask, m->rollback, m->is_terminated}) {
    if (!f) throw std::invalid_argument("grammar node: a matcher method handle is null");
    m->api.object_inc_ref(f);  // held for the process: graphs may replay the node until it exits
  }
  return m;
}

// A step's snapshot from its rows' registry entries (registry.h); feed[feed_offsets[i]:feed_offsets[i + 1]] are row
// i's host-known tokens. `python`: the step takes the Python path anyway (a row with a wrapper matcher does too).
std::shared_ptr<Snapshot> make_snapshot(std::shared_ptr<Registry> registry, uint64_t id, int slot, int prev,
                                        int64_t step, int width, bool python, const std::vector<int64_t>& rows,
                                        const std::vector<int64_t>& entries, const std::vector<int64_t>& feed_start,
                                        const std::vector<int64_t>& feed_offsets, const std::vector<int64_t>& feed,
                                        const std::vector<int64_t>& pending_src,
                                        const std::vector<int64_t>& pending_step, std::vector<int64_t> unguided) {
  size_t n = rows.size();
  if (!registry) throw std::invalid_argument("grammar node: a snapshot needs its registry");
  if (entries.size() != n || feed_start.size() != n || feed_offsets.size() != n + 1 || pending_src.size() != n ||
      pending_step.size() != n)
    throw std::invalid_argument("grammar node: a snapshot's row fields differ in length");
  if (feed_offsets[0] != 0 || feed_offsets[n] != static_cast<int64_t>(feed.size()))
    throw std::invalid_argument("grammar node: a snapshot's feed offsets do not span its feed");
  for (size_t i = 0; i < n; ++i)
    if (feed_offsets[i + 1] < feed_offsets[i]) throw std::invalid_argument("grammar node: feed offsets decrease");
  if (slot < 0 || slot > 1 || prev < 0 || prev > 1 || width < 1)
    throw std::invalid_argument("grammar node: bad slot, previous slot or width");
  bool wrapped = false;
  registry->each(entries.data(), n, [&](size_t i, const Entry& e) { wrapped = wrapped || e.python(); });
  auto s = std::make_shared<Snapshot>(registry->matchers(), id, slot, prev, step, width, python || wrapped);
  s->rows.reserve(n);
  s->feed.reserve(feed.size());
  registry->each(entries.data(), n, [&](size_t i, const Entry& e) {
    s->add_row(rows[i], e.state, e.matcher, e.llg, feed_start[i], feed.data() + feed_offsets[i],
               static_cast<size_t>(feed_offsets[i + 1] - feed_offsets[i]), pending_src[i], pending_step[i]);
  });
  s->unguided = std::move(unguided);
  return s;
}

Bitmask bitmask(uintptr_t data, int64_t rows, int64_t words) {
  Bitmask b;
  b.data = reinterpret_cast<int32_t*>(data);
  b.shape[0] = rows;
  b.shape[1] = words;
  return b;
}

template <typename T>
T* ptr(uintptr_t p) { return reinterpret_cast<T*>(p); }

}  // namespace

// [g.entry(registry) for g in requests] (Snapshot.bind): a request's cached (registry, index) where it is this
// registry's, else its entry() call (which registers it).
py::list registry_entries(py::object registry, py::list requests) {
  static PyObject* const cached = PyUnicode_InternFromString("_entry");
  static PyObject* const entry = PyUnicode_InternFromString("entry");
  py::list out(PyList_GET_SIZE(requests.ptr()));
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(requests.ptr()); ++i) {
    PyObject* g = PyList_GET_ITEM(requests.ptr(), i);
    py::object e = py::reinterpret_steal<py::object>(PyObject_GetAttr(g, cached));
    if (!e) throw py::error_already_set();
    py::object index;
    if (PyTuple_CheckExact(e.ptr()) && PyTuple_GET_SIZE(e.ptr()) == 2 && PyTuple_GET_ITEM(e.ptr(), 0) == registry.ptr())
      index = py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(e.ptr(), 1));
    else if (!(index = py::reinterpret_steal<py::object>(PyObject_CallMethodOneArg(g, entry, registry.ptr()))))
      throw py::error_already_set();
    PyList_SET_ITEM(out.ptr(), i, index.release().ptr());
  }
  return out;
}

PYBIND11_MODULE(_native, m) {
  m.doc() = "The grammar node: guided rows' masks filled in native code on the driver's thread, no GIL";

  py::class_<Matchers, std::shared_ptr<Matchers>>(m, "Matchers");
  m.def("matchers", &make_matchers, py::arg("lib"), py::arg("accept_token"), py::arg("fill_next_token_bitmask"),
        py::arg("rollback"), py::arg("is_terminated"),
        "Bind libtvm_ffi and xgrammar's GrammarMatcher method handles (tvm-ffi Function objects).");

  py::class_<RowState, std::shared_ptr<RowState>>(m, "RowState")
      .def(py::init<>())
      .def_property("accepted", [](const RowState& s) { return s.accepted.load(); },
                    [](RowState& s, int64_t v) { s.accepted.store(v); })
      .def_property("through_step", [](const RowState& s) { return s.through_step.load(); },
                    [](RowState& s, int64_t v) { s.through_step.store(v); })
      .def_property("error", &RowState::error, [](RowState& s, std::optional<std::string> e) {
        if (e) s.set_error(*e);
        else s.clear_error();
      });

  py::class_<Registry, std::shared_ptr<Registry>>(m, "Registry")
      .def(py::init<std::shared_ptr<const Matchers>>(), py::arg("matchers"))
      .def("add", &Registry::add, py::arg("state"), "Register a request's state -> its index.")
      .def("set_matcher", [](Registry& r, int64_t i, uintptr_t handle, std::shared_ptr<LlgRowMatcher> llg) {
             r.set_matcher(i, reinterpret_cast<void*>(handle), std::move(llg));
           }, py::arg("index"), py::arg("handle"), py::arg("llg"),
           "Its matcher: xgrammar's tvm-ffi handle (0: none) and llguidance's native matcher (None: none).")
      .def("remove", &Registry::remove, py::arg("index"))
      .def_property_readonly("live", &Registry::live);

  m.def("registry_entries", &registry_entries, py::arg("registry"), py::arg("requests"),
        "Each GuidedRequest's index in `registry`, as GuidedRequest.entry gives it.");

  py::class_<Snapshot, std::shared_ptr<Snapshot>>(m, "Snapshot")
      .def(py::init(&make_snapshot), py::arg("registry"), py::arg("id"), py::arg("slot"), py::arg("prev"),
           py::arg("step"), py::arg("width"), py::arg("python"), py::arg("rows"), py::arg("entries"),
           py::arg("feed_start"), py::arg("feed_offsets"), py::arg("feed"), py::arg("pending_src"),
           py::arg("pending_step"), py::arg("unguided"))
      .def_readonly("id", &Snapshot::id)
      .def_property("consumed", [](const Snapshot& s) { return s.consumed.load(); },
                    [](Snapshot& s, bool v) { s.consumed.store(v); })
      .def_property("failure", &Snapshot::failure, &Snapshot::set_failure)
      .def_property_readonly("times", &Snapshot::times)
      .def("is_done", &Snapshot::is_done)
      .def("wait", &Snapshot::wait, py::arg("timeout"), py::call_guard<py::gil_scoped_release>());

  py::class_<Node, std::unique_ptr<Node, py::nodelete>>(m, "Node")
      // Never deleted: graphs that captured it hold its address. close() releases what it holds.
      .def(py::init([](std::shared_ptr<const Matchers> matchers, int threads, int64_t min_parallel_rows) {
             return new Node(std::move(matchers), threads, min_parallel_rows);
           }), py::arg("matchers"), py::arg("threads") = 1, py::arg("min_parallel_rows") = 8)
      .def("set_target", [](Node& n, std::vector<uintptr_t> masks, int64_t mask_rows, int64_t words,
                            std::vector<uintptr_t> tokens, int64_t token_cols, std::vector<uintptr_t> drafts,
                            std::vector<uintptr_t> caps, int64_t k) {
             if (masks.size() != 2 || tokens.size() != 2 || drafts.size() != 2 || caps.size() != 2)
               throw std::invalid_argument("grammar node: one buffer per slot (2)");
             for (int i = 0; i < 2; ++i) {
               n.target.mask[i] = bitmask(masks[i], mask_rows, words);
               n.target.tokens[i] = ptr<int64_t>(tokens[i]);
               n.target.drafts[i] = ptr<int64_t>(drafts[i]);
               n.target.caps[i] = ptr<int64_t>(caps[i]);
             }
             n.target.token_cols = token_cols;
             n.target.k = k;
           })
      .def("set_tree", [](Node& n, int64_t depth, std::vector<int64_t> leaf_depths) {
             for (int64_t d : leaf_depths)
               if (d < 1 || d > depth) throw std::invalid_argument("grammar node: a leaf's depth lies outside its tree's chain");
             Tree t;
             t.depth = depth;
             t.leaf_depths = std::move(leaf_depths);
             for (int64_t i = 0; i < static_cast<int64_t>(t.leaf_depths.size()); ++i) t.deepest_first.push_back(i);
             std::stable_sort(t.deepest_first.begin(), t.deepest_first.end(),
                              [&](int64_t a, int64_t b) { return t.leaf_depths[a] > t.leaf_depths[b]; });
             n.target.tree = std::move(t);
           }, py::arg("depth"), py::arg("leaf_depths"),
           "A tree engine's draft tree: steps of width k + 1 walk it (set before any run).")
      .def("set_draft", [](Node& n, std::vector<uintptr_t> masks, std::vector<uintptr_t> ctl,
                           std::vector<uintptr_t> tokens, int64_t rows, int64_t words, int64_t calls,
                           bool draft_masks, bool forced) {
             if (ctl.size() != masks.size() || tokens.size() != masks.size())
               throw std::invalid_argument("grammar node: one mask, control and token buffer per draft step");
             if (calls < 1 || calls > static_cast<int64_t>(masks.size()))
               throw std::invalid_argument("grammar node: draft calls must be in [1, draft steps]");
             n.draft = DraftBuffers{};
             for (size_t j = 0; j < masks.size(); ++j) {
               n.draft.mask.push_back(bitmask(masks[j], rows, words));
               n.draft.ctl.push_back(ptr<int64_t>(ctl[j]));
               n.draft.tokens.push_back(ptr<int64_t>(tokens[j]));
             }
             n.draft.calls = calls;
             n.draft.steps = static_cast<int64_t>(masks.size());
             n.draft.masks = draft_masks;
             n.draft.forced = forced;
             n.draft_calls.clear();
             for (int64_t j = 0; j < calls; ++j) n.draft_calls.push_back(DraftCall{&n, static_cast<int>(j)});
           }, py::arg("masks"), py::arg("ctl"), py::arg("tokens"), py::arg("rows"), py::arg("words"), py::arg("calls"),
           py::arg("draft_masks"), py::arg("forced"))
      .def("set_forced", [](Node& n, std::shared_ptr<ClosingSearch> search, std::shared_ptr<ForcedTokens> tokens_of) {
             n.set_forced(std::move(search), std::move(tokens_of));
           }, py::arg("search"), py::arg("tokens_of"),
           "Forced drafts' jump-forward call and tokens: from now on the native draft nodes draft them.")
      .def("set_python", [](Node& n, uintptr_t trampoline, uint64_t target, std::vector<uint64_t> draft) {
             n.trampoline = reinterpret_cast<Trampoline>(trampoline);
             n.python_target = target;
             n.python_draft = std::move(draft);
           })
      .def("push", &Node::push)
      .def("unpush", &Node::unpush, py::arg("id"))
      .def("queued", &Node::queued)
      .def("last_id", [](Node& n) -> std::optional<uint64_t> {
             auto s = n.last();
             if (!s) return std::nullopt;
             return s->id;
           })
      .def("run", &Node::run_target, py::call_guard<py::gil_scoped_release>(),
           "Run the target node here (the CPU's inline path), GIL released.")
      .def("run_draft", &Node::run_draft, py::arg("j"), py::call_guard<py::gil_scoped_release>())
      .def("close", &Node::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("draft_seconds", &Node::draft_seconds)
      .def_property_readonly("forced_drafts", &Node::forced_drafts)
      .def_property_readonly("address", [](Node& n) { return reinterpret_cast<uintptr_t>(&n); })
      .def("draft_address", [](Node& n, int j) {
             if (j < 0 || j >= static_cast<int>(n.draft_calls.size())) throw py::index_error("no such draft step");
             return reinterpret_cast<uintptr_t>(&n.draft_calls[j]);
           });

  m.def("_fill_row_for_test", [](std::shared_ptr<const Matchers> matchers, uintptr_t matcher, uintptr_t data,
                                  int64_t rows, int64_t words, int64_t index) {
          Bitmask b = bitmask(data, rows, words);
          DLTensor t = b.tensor();
          Call c = fill_mask(*matchers, reinterpret_cast<void*>(matcher), &t, index);
          return py::make_tuple(c.ok, c.value, c.error);
        }, "One fill_next_token_bitmask call as the node makes it: (ok, result, error text).");
  py::class_<ForcedTokens, std::shared_ptr<ForcedTokens>>(m, "ForcedTokens")
      .def(py::init([](std::shared_ptr<ClosingVocab> vocab, size_t capacity) {
             return std::make_shared<ForcedTokens>(std::move(vocab), capacity);
           }), py::arg("vocab"), py::arg("capacity"))
      .def("tokens", [](ForcedTokens& f, py::bytes text) { return f.tokens(std::string(text)); }, py::arg("text"))
      .def("take", [](ForcedTokens& f) {
             std::vector<py::bytes> out;
             for (std::string& t : f.take()) out.emplace_back(t);
             return out;
           }, "The texts drafted by longest match since the last take.")
      .def("teach", [](ForcedTokens& f, py::bytes text, std::vector<int64_t> tokens) {
             f.teach(std::string(text), std::move(tokens));
           }, py::arg("text"), py::arg("tokens"))
      .def_property_readonly("known", &ForcedTokens::known);
  bind_llg(m);
  bind_closing(m);
  m.attr("TARGET_NODE") = reinterpret_cast<uintptr_t>(&target_node);
  m.attr("DRAFT_NODE") = reinterpret_cast<uintptr_t>(&draft_node);
}
