// What the grammar node does to one row's matcher: accept the tokens it lacks, fill its masks along its
// drafts and roll the walk back. The same steps, in the same order and with the same error texts, as the
// Python path (engine/guided/matching.py); rows are independent, so the node may run them in parallel.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "snapshot.h"

namespace grammar_node {

// A host bitmask [rows, words] of int32 that xgrammar fills one row at a time.
struct Bitmask {
  int32_t* data = nullptr;
  int64_t shape[2] = {0, 0};
  DLTensor tensor() {
    return DLTensor{data, DLDevice{kDLCPU, 0}, 2, DLDataType{kDLInt, 32, 1}, shape, nullptr, 0};
  }
  bool holds(int64_t row) const { return row >= 0 && row < shape[0]; }
  void allow_all(int64_t row) {
    if (holds(row)) std::memset(data + row * shape[1], 0xff, sizeof(int32_t) * shape[1]);
  }
};

// A draft tree's shape, as the grammar node walks it: the chain's drafts, each leaf's depth (leaf i is draft
// depth + i and input depth + 1 + i), and the leaves in order of depth, deepest first.
struct Tree {
  int64_t depth = 0;  // 0: the engine drafts chains
  std::vector<int64_t> leaf_depths;
  std::vector<int64_t> deepest_first;
};

class RowOps {
 public:
  RowOps(const Matchers& m, const Row& r) : m_(m), r_(r), state_(*r.state) {}

  bool failed() const { return state_.failed(); }

  // The matcher still takes tokens; a failing check fails the request.
  bool live() {
    if (state_.failed()) return false;
    Call t = terminated();
    if (!t.ok) return fail(failed_message(t.error));
    return !t.value;
  }

  // Feed tokens one by one, counting them (tokens after the matcher terminated included).
  bool advance(const int64_t* tokens, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      int64_t tok = tokens[i];
      if (tok < 0) return fail("no token was allowed here (the request's token mask was empty)");
      state_.accepted.fetch_add(1, std::memory_order_release);
      Call t = terminated();
      if (!t.ok) return fail(failed_message(t.error));
      if (t.value) continue;  // ended with its stop token: nothing more to accept
      Call a = accept(tok);
      if (!a.ok) return fail(failed_message(a.error));
      if (!a.value) return fail("the grammar rejected token " + std::to_string(tok));
    }
    return true;
  }

  // The row's host-known tokens it has not accepted yet, then the tokens `emitted` (a row of a step's output:
  // the first always, then until the first PAD) unless this step's tokens were accepted already.
  void accept(const std::vector<int64_t>& feed, const int64_t* emitted, int64_t cols, int64_t step) {
    if (state_.failed()) return;
    int64_t skip = state_.accepted.load(std::memory_order_acquire) - r_.feed_start;
    int64_t n = static_cast<int64_t>(r_.feed_end - r_.feed_begin);
    if (skip < n) {
      size_t from = r_.feed_begin + static_cast<size_t>(skip > 0 ? skip : 0);
      if (!advance(feed.data() + from, r_.feed_end - from)) return;
    }
    if (!emitted || state_.through_step.load(std::memory_order_acquire) >= step) return;
    state_.through_step.store(step, std::memory_order_release);
    int64_t count = 1;
    while (count < cols && emitted[count] >= 0) ++count;
    advance(emitted, static_cast<size_t>(count));
  }

  // Fill mask row `index`; a failure fails the request and leaves the row all-allowed.
  bool fill(Bitmask& mask, int64_t index) {
    Call f;
    if (r_.llg) {
      f = r_.llg->fill(mask.data + index * mask.shape[1], mask.shape[1]);
    } else {
      DLTensor t = mask.tensor();
      f = fill_mask(m_, r_.matcher, &t, index);
    }
    if (f.ok) return true;
    mask.allow_all(index);
    return fail(failed_message(f.error));
  }

  // Accept one draft token: 1 accepted, 0 rejected (or a bad id: stop walking, the request goes on).
  bool try_draft(int64_t token) {
    Call a = accept(token);
    return a.ok && a.value;
  }

  // Accept draft token `token` picked under this row's draft mask: a raise fails the request.
  bool accept_drafted(int64_t token) {
    Call a = accept(token);
    if (!a.ok) return fail(failed_message(a.error));
    return a.value != 0;
  }

  bool terminated_after_draft() {
    Call t = terminated();
    if (!t.ok) {
      fail(failed_message(t.error));
      return true;
    }
    return t.value != 0;
  }

  void undo(int64_t n) {
    if (n <= 0) return;
    Call b = r_.llg ? r_.llg->rollback(n) : rollback(m_, r_.matcher, n);
    if (!b.ok) fail(failed_message(b.error));
  }

  // Masks of every position along the row's drafts (position j + 1 after drafts[0..j]); stops at a draft the
  // grammar rejects, at `count`, or once the matcher terminates; returns the drafts it accepted, rolled back.
  int64_t walk(Bitmask& mask, int64_t width, const int64_t* drafts, int64_t count) {
    if (!live() || !fill(mask, r_.row * width)) return 0;
    int64_t walked = 0;
    for (int64_t j = 0; j + 1 < width && j < count && !state_.failed(); ++j) {
      if (!try_draft(drafts[j])) break;
      ++walked;
      if (terminated_after_draft() || !fill(mask, r_.row * width + j + 1)) break;
    }
    undo(walked);
    return walked;
  }

  // A draft tree's masks (engine/speculative/tree.py): the chain's first `tree.depth` drafts as walk() fills
  // them, then each leaf's mask at its input, after the chain's first depth - 1 drafts and the leaf, where
  // the grammar accepts the leaf (else its rows stay all-allowed: its parent's mask already rules it out). A
  // leaf equal to its chain sibling is skipped: the target never accepts it (under draft masks, a rank past the
  // tokens the mask allows repeats the sibling).
  // Returns the deepest depth a draft may be accepted at: one past the chain drafts the grammar accepted (a
  // leaf beside the rejected one), unless the matcher terminated there; at most `count`.
  int64_t walk_tree(Bitmask& mask, int64_t width, const int64_t* drafts, int64_t count, const Tree& tree) {
    if (!live() || !fill(mask, r_.row * width)) return 0;
    int64_t walked = 0;
    bool ended = false;
    for (int64_t j = 0; j < std::min(tree.depth, count) && !state_.failed(); ++j) {
      if (!try_draft(drafts[j])) break;
      ++walked;
      if ((ended = terminated_after_draft()) || !fill(mask, r_.row * width + j + 1)) break;
    }
    const int64_t reach = std::min(count, walked + (ended ? 0 : 1));
    int64_t held = walked;  // drafts the matcher holds; leaves go deepest first, one rollback per depth
    for (int64_t i : tree.deepest_first) {
      const int64_t d = tree.leaf_depths[i];
      if (d > reach || state_.failed() || drafts[tree.depth + i] == drafts[d - 1]) continue;
      undo(held - (d - 1));
      held = d - 1;
      if (!try_draft(drafts[tree.depth + i])) continue;
      if (!terminated_after_draft()) fill(mask, r_.row * width + tree.depth + 1 + i);
      undo(1);
    }
    undo(held);
    return reach;
  }

 private:
  // The row's backend: xgrammar's matcher through tvm-ffi, or llguidance's through its C API.
  Call accept(int64_t token) { return r_.llg ? r_.llg->accept_token(token) : accept_token(m_, r_.matcher, token); }
  Call terminated() { return r_.llg ? Call{true, r_.llg->is_terminated(), {}} : is_terminated(m_, r_.matcher); }

  bool fail(std::string message) {
    state_.set_error(std::move(message));
    return false;
  }

  const Matchers& m_;
  const Row& r_;
  RowState& state_;
};

}  // namespace grammar_node
