// The grammar node's runs (see node.h).
#include "node.h"

#include <algorithm>
#include <exception>
#include <stdexcept>
#include <string>

namespace grammar_node {

void Node::push(std::shared_ptr<Snapshot> s) {
  std::lock_guard<std::mutex> lock(queue_mu_);
  if (!closed_) queue_.push_back(std::move(s));
}

bool Node::unpush(uint64_t id) {
  std::lock_guard<std::mutex> lock(queue_mu_);
  auto it = std::find_if(queue_.begin(), queue_.end(), [&](const auto& s) { return s->id == id; });
  if (it == queue_.end()) return false;
  queue_.erase(it);
  return true;
}

size_t Node::queued() {
  std::lock_guard<std::mutex> lock(queue_mu_);
  return queue_.size();
}

std::shared_ptr<Snapshot> Node::last() {
  std::lock_guard<std::mutex> lock(queue_mu_);
  return last_;
}

std::shared_ptr<Snapshot> Node::next() {
  std::lock_guard<std::mutex> lock(queue_mu_);
  if (closed_) return nullptr;
  if (!queue_.empty()) {  // an empty queue (warm-up, capture) reuses the last snapshot
    last_ = std::move(queue_.front());
    queue_.pop_front();
  }
  return last_;
}

void Node::close() {
  std::lock_guard<std::mutex> run(run_mu_);
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    closed_ = true;
    queue_.clear();
    last_.reset();
  }
  pool_.stop();
}

void Node::for_rows(const Snapshot& s, const std::function<void(size_t)>& fn) {
  size_t n = s.rows.size();
  if (pool_.threads() > 1 && static_cast<int64_t>(n) >= min_parallel_rows_) pool_.run(n, fn);
  else for (size_t i = 0; i < n; ++i) fn(i);
}

void Node::call_python(uint64_t handle) {
  if (!trampoline || !handle) throw std::runtime_error("this step needs the Python grammar callback, and none is registered");
  trampoline(reinterpret_cast<void*>(static_cast<uintptr_t>(handle)));
}

void Node::fill_target(Snapshot& s, bool accept) {
  TargetBuffers& b = target;
  const int64_t w = s.width, k = b.k;
  Bitmask& mask = b.mask[s.slot];
  int64_t* caps = b.caps[s.slot];
  const int64_t* drafts = b.drafts[s.slot];
  for (int64_t u : s.unguided) {
    if (!mask.holds(u * w + w - 1)) continue;
    for (int64_t j = 0; j < w; ++j) mask.allow_all(u * w + j);
    caps[u] = k;
  }
  const int64_t cols = std::min(k + 1, b.token_cols);
  for_rows(s, [&](size_t i) {
    const Row& r = s.rows[i];
    if (!mask.holds(r.row * w + w - 1)) {
      r.state->set_error("grammar node: sampling row " + std::to_string(r.row) + " is outside the mask buffer");
      return;
    }
    RowOps ops(*matchers_, r);
    if (accept) {
      const int64_t* emitted = r.pending_src >= 0 ? b.tokens[s.prev] + r.pending_src * b.token_cols : nullptr;
      ops.accept(s.feed, emitted, cols, r.pending_step);
    }
    caps[r.row] = 0;
    for (int64_t j = 0; j < w; ++j) mask.allow_all(r.row * w + j);
    const int64_t* row_drafts = drafts ? drafts + r.row * (k + 1) : nullptr;
    int64_t count = w > 1 && row_drafts ? row_drafts[k] : 0;
    const bool tree = b.tree.depth > 0 && w == k + 1;
    caps[r.row] = tree ? ops.walk_tree(mask, w, row_drafts, count, b.tree) : ops.walk(mask, w, row_drafts, count);
  });
}

void Node::run_target() {
  std::lock_guard<std::mutex> run(run_mu_);
  std::shared_ptr<Snapshot> s = next();
  if (!s) return;
  double start = monotonic_seconds();
  try {
    if (s->python) call_python(python_target);
    else fill_target(*s, !s->consumed.load(std::memory_order_acquire));
  } catch (const std::exception& e) {
    s->fail(std::string("grammar node: ") + e.what());
  }
  s->consumed.store(true, std::memory_order_release);
  s->finish(start, monotonic_seconds());
}

void Node::draft_step(Snapshot& s, int j) {
  const int64_t k = target.k;
  Bitmask& mask = draft.mask[j];
  int64_t* ctl = draft.ctl[j];
  const int64_t* tokens = draft.tokens[j];
  const int64_t cols = j == 0 ? k + 1 : 1;
  for (int64_t u : s.unguided) {
    if (!mask.holds(u)) continue;
    std::fill(ctl + u * k, ctl + (u + 1) * k, kFree);
    mask.allow_all(u);
  }
  if (j == 0) {
    going_.assign(s.rows.size(), 0);
    walked_.assign(s.rows.size(), 0);
  }
  for_rows(s, [&](size_t i) {
    const Row& r = s.rows[i];
    if (!mask.holds(r.row)) {
      r.state->set_error("grammar node: sampling row " + std::to_string(r.row) + " is outside the draft buffers");
      going_[i] = 0;
      return;
    }
    RowOps ops(*matchers_, r);
    if (j == 0) {
      ops.accept(s.feed, tokens + r.row * cols, cols, s.step);
      going_[i] = ops.live();
    } else if (going_[i]) {
      going_[i] = 0;
      if (ops.accept_drafted(tokens[r.row * cols])) {
        ++walked_[i];
        going_[i] = !ops.terminated_after_draft();
      }
    }
    if (!going_[i]) {
      std::fill(ctl + r.row * k, ctl + (r.row + 1) * k, kStop);
      mask.allow_all(r.row);
      return;
    }
    if (draft.masks) ops.fill(mask, r.row);
    std::fill(ctl + r.row * k, ctl + (r.row + 1) * k, kFree);
    if (draft.forced && r.matcher && !ops.failed()) force(r, j, ctl + r.row * k, mask);
  });
}

// Draft the jump-forward text's tokens from draft j on (under draft masks its first alone, where the mask allows
// it): all but its last, which may merge with what follows. A text no token spells drafts nothing.
void Node::force(const Row& r, int j, int64_t* ctl_row, const Bitmask& mask) {
  std::string text;
  try {
    text = jump_forward(*draft.search, r.matcher);
  } catch (const std::exception& e) {
    r.state->set_error(failed_message(e.what()));
    return;
  }
  if (text.empty()) return;
  std::vector<int64_t> toks;
  try {
    toks = draft.tokens_of->tokens(text);
  } catch (const std::invalid_argument&) {
    return;
  }
  const int64_t n = std::min<int64_t>(static_cast<int64_t>(toks.size()) - 1, draft.masks ? 1 : draft.steps - j);
  if (n <= 0) return;
  if (draft.masks) {
    const int64_t word = toks[0] >> 5;
    if (word >= mask.shape[1] || !((mask.data[r.row * mask.shape[1] + word] >> (toks[0] & 31)) & 1)) return;
  }
  std::copy(toks.begin(), toks.begin() + n, ctl_row + j);
  forced_drafts_.fetch_add(n, std::memory_order_relaxed);
}

void Node::roll_back_drafts(Snapshot& s) {
  for (size_t i = 0; i < s.rows.size() && i < walked_.size(); ++i) {
    RowOps ops(*matchers_, s.rows[i]);
    ops.undo(walked_[i]);
  }
  walked_.assign(walked_.size(), 0);
}

void Node::run_draft(int j) {
  std::lock_guard<std::mutex> run(run_mu_);
  std::shared_ptr<Snapshot> s = last();
  if (!s || j < 0 || j >= draft.calls) return;
  if (s->python || (draft.forced && !draft.tokens_of)) {  // the Python path times itself and rolls back its own drafts
    try {
      call_python(j < static_cast<int>(python_draft.size()) ? python_draft[j] : 0);
    } catch (const std::exception& e) {
      s->fail(std::string("grammar node: ") + e.what());
    }
    return;
  }
  double start = monotonic_seconds();
  try {
    draft_step(*s, j);
  } catch (const std::exception& e) {
    s->fail(std::string("grammar node: ") + e.what());
  }
  if (j == draft.calls - 1) roll_back_drafts(*s);
  draft_ns_.fetch_add(static_cast<int64_t>(1e9 * (monotonic_seconds() - start)), std::memory_order_relaxed);
}

void Node::set_forced(std::shared_ptr<const ClosingSearch> search, std::shared_ptr<ForcedTokens> tokens_of) {
  if (!search || !tokens_of) throw std::invalid_argument("grammar node: forced drafts need a search and their tokens");
  std::lock_guard<std::mutex> run(run_mu_);
  draft.search = std::move(search);
  draft.tokens_of = std::move(tokens_of);
}

void target_node(void* node) { static_cast<Node*>(node)->run_target(); }

void draft_node(void* call) {
  auto* c = static_cast<DraftCall*>(call);
  c->node->run_draft(c->j);
}

}  // namespace grammar_node
