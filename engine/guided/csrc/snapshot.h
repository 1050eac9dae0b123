// A step's guided rows as plain data: what the loop thread hands the grammar node for one step.
//
// Built by the loop thread (engine/guided/snapshot.py) before the step launches, read by the node on the
// driver's thread; after construction only `consumed`, the failure, the times and `done` change, under its
// mutex or atomically. Each row holds a strong reference to its matcher object, released when the snapshot
// goes (possibly on the driver's thread: a matcher's destructor is plain C++, llguidance's too).
#pragma once

#include <time.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "llg.h"
#include "matcher.h"

namespace grammar_node {

inline double monotonic_seconds() {  // the clock of Python's time.perf_counter on Linux
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

struct Row {
  int64_t row;                      // sampling row of the step (its masks start at row * width)
  std::shared_ptr<RowState> state;
  void* matcher;                    // strong reference to xgrammar's GrammarMatcher object (null: llguidance's)
  std::shared_ptr<LlgRowMatcher> llg;  // the row's llguidance matcher (null: xgrammar's)
  int64_t feed_start;               // output index of the first host-known token of `feed`
  size_t feed_begin, feed_end;      // the row's host-known tokens in Snapshot::feed
  int64_t pending_src;              // row of the previous step's emitted tokens to accept after them (-1: none)
  int64_t pending_step;             // the step that emitted them
};

class Snapshot {
 public:
  Snapshot(std::shared_ptr<const Matchers> matchers, uint64_t id, int slot, int prev, int64_t step, int width,
           bool python)
      : matchers(std::move(matchers)), id(id), slot(slot), prev(prev), step(step), width(width), python(python) {}

  ~Snapshot() {
    for (const Row& r : rows)
      if (r.matcher) matchers->api.object_dec_ref(r.matcher);
  }

  void add_row(int64_t row, std::shared_ptr<RowState> state, void* matcher, std::shared_ptr<LlgRowMatcher> llg,
               int64_t feed_start, const int64_t* tokens, size_t n, int64_t pending_src, int64_t pending_step) {
    if (matcher) matchers->api.object_inc_ref(matcher);
    size_t begin = feed.size();
    feed.insert(feed.end(), tokens, tokens + n);
    rows.push_back(Row{row, std::move(state), matcher, std::move(llg), feed_start, begin, feed.size(), pending_src,
                       pending_step});
  }

  void fail(std::string message) {  // the callback failed as a whole: every guided row of the step fails
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_) failure_ = std::move(message);
  }

  void set_failure(std::optional<std::string> message) {
    std::lock_guard<std::mutex> lock(mu_);
    failure_ = std::move(message);
  }

  std::optional<std::string> failure() const {
    std::lock_guard<std::mutex> lock(mu_);
    return failure_;
  }

  void finish(double start, double end) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      times_ = {start, end};
      done_ = true;
    }
    done_cv_.notify_all();
  }

  std::optional<std::pair<double, double>> times() const {
    std::lock_guard<std::mutex> lock(mu_);
    return times_;
  }

  bool is_done() const {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }

  bool wait(double timeout_s) const {
    std::unique_lock<std::mutex> lock(mu_);
    return done_cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return done_; });
  }

  const std::shared_ptr<const Matchers> matchers;
  const uint64_t id;
  const int slot, prev;
  const int64_t step;
  const int width;           // masks per sampling row: 1 + the drafts it verifies
  const bool python;         // a row's matcher is neither backend's native one: the Python callback runs this step
  std::vector<Row> rows;
  std::vector<int64_t> feed;
  std::vector<int64_t> unguided;
  std::atomic<bool> consumed{false};  // its tokens were accepted (a reuse only refills the masks)

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable done_cv_;
  std::optional<std::string> failure_;
  std::optional<std::pair<double, double>> times_;
  bool done_ = false;
};

}  // namespace grammar_node
