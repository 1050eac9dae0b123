// The grammar node: the host function a step graph replays on `grammar_stream` for guided rows, in native
// code that never takes the GIL.
//
// Target node (one per step): pop the step's snapshot (or reuse the last one when none was queued: warm-up and
// capture), accept each row's tokens, fill its 1 + K masks along its drafts, roll the walk back, and write
// the drafts each row's grammar accepts. Draft node j (one per draft step with draft masks, else one for
// forced drafts alone): accept the previous draft token (j = 0: the step's emitted tokens), fill draft mask j
// (draft masks) and control row j (forced drafts: the jump-forward text's tokens, forced_tokens.h); the last
// one rolls back every draft the draft nodes accepted. A snapshot whose rows have a matcher that is not
// xgrammar's own (a Python wrapper) runs the Python callback instead, through hostfunc's trampoline (it takes
// the GIL).
//
// Threads: the loop thread pushes snapshots (queue_mu_); the node runs on the driver's thread (or inline on
// the CPU, GIL released), one run at a time (run_mu_, which close() takes too). Buffers are the engine's
// pinned host tensors, registered once; the engine keeps them alive as long as this node may run.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "closing.h"
#include "forced_tokens.h"
#include "pool.h"
#include "rows.h"

namespace grammar_node {

constexpr int64_t kFree = -1, kStop = -2;  // control row values: the drafter's own token, stop drafting

struct TargetBuffers {
  Bitmask mask[2];          // [rows * (K + 1), words] per slot
  int64_t* tokens[2] = {};  // previous step's emitted tokens [rows, token_cols]
  int64_t token_cols = 1;
  int64_t* drafts[2] = {};  // [rows, K + 1]: the drafts, then their count
  int64_t* caps[2] = {};    // [rows]: the drafts each row's grammar accepts
  int64_t k = 0;
  Tree tree;                // a tree engine's: steps of width k + 1 verify it
};

struct DraftBuffers {
  std::vector<Bitmask> mask;       // per draft step: [rows, words]
  std::vector<int64_t*> ctl;       // per draft step: [rows, K]
  std::vector<int64_t*> tokens;    // step 0: [rows, K + 1] the emitted tokens; step j: [rows, 1] draft j - 1
  int64_t calls = 0;               // draft nodes a drafting step runs
  int64_t steps = 0;               // draft steps (mask buffers): a tree's chain, else K
  bool masks = true;               // fill draft mask j
  bool forced = false;             // grammar-forced drafts; until `tokens_of` is set, the Python path drafts them
  std::shared_ptr<const ClosingSearch> search;  // its find_jump_forward_string handle
  std::shared_ptr<ForcedTokens> tokens_of;      // what tokenizes the jump-forward text
};

class Node;
struct DraftCall {  // the user data of draft node j
  Node* node;
  int j;
};

using Trampoline = void (*)(void*);

class Node {
 public:
  Node(std::shared_ptr<const Matchers> matchers, int threads, int64_t min_parallel_rows)
      : matchers_(std::move(matchers)), pool_(threads), min_parallel_rows_(min_parallel_rows),
        last_(std::make_shared<Snapshot>(matchers_, 0, 0, 1, -1, 1, false)) {}

  TargetBuffers target;
  DraftBuffers draft;
  std::vector<DraftCall> draft_calls;
  Trampoline trampoline = nullptr;   // hostfunc's: runs a standing Python entry with the GIL
  uint64_t python_target = 0;        // standing entries of the Python path (0: none)
  std::vector<uint64_t> python_draft;

  void push(std::shared_ptr<Snapshot> s);
  bool unpush(uint64_t id);
  size_t queued();
  std::shared_ptr<Snapshot> last();
  void run_target();
  void run_draft(int j);
  void set_forced(std::shared_ptr<const ClosingSearch> search, std::shared_ptr<ForcedTokens> tokens_of);
  void close();
  double draft_seconds() const { return 1e-9 * static_cast<double>(draft_ns_.load(std::memory_order_relaxed)); }
  int64_t forced_drafts() const { return forced_drafts_.load(std::memory_order_relaxed); }

 private:
  std::shared_ptr<Snapshot> next();
  void for_rows(const Snapshot& s, const std::function<void(size_t)>& fn);
  void fill_target(Snapshot& s, bool accept);
  void draft_step(Snapshot& s, int j);
  void force(const Row& r, int j, int64_t* ctl_row, const Bitmask& mask);
  void roll_back_drafts(Snapshot& s);
  void call_python(uint64_t handle);

  std::shared_ptr<const Matchers> matchers_;
  Pool pool_;
  const int64_t min_parallel_rows_;
  std::mutex queue_mu_;  // guards queue_, last_, closed_
  std::deque<std::shared_ptr<Snapshot>> queue_;
  std::shared_ptr<Snapshot> last_;
  bool closed_ = false;
  std::mutex run_mu_;    // one run at a time; close() waits for a running one
  std::vector<uint8_t> going_;     // draft nodes: row i of the last snapshot still drafting
  std::vector<int64_t> walked_;    // draft nodes: drafts row i's matcher accepted (rolled back by the last)
  std::atomic<int64_t> draft_ns_{0};  // host time inside native draft nodes
  std::atomic<int64_t> forced_drafts_{0};  // forced tokens the native draft nodes drafted
};

void target_node(void* node);  // cuLaunchHostFunc entry points
void draft_node(void* call);

}  // namespace grammar_node
