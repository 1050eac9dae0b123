// Guided requests' native handles, registered once per request (engine/guided/masks.py), so that a step's
// snapshot names each row by its registry index instead of passing the row's objects through pybind11 every step.
//
// The loop thread adds entries and builds snapshots from them; an entry is removed when its request is collected,
// on whichever thread drops it, hence the mutex. The grammar node never reads the registry: a snapshot takes its
// own references to each row's state and matcher when it is built.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "llg.h"
#include "matcher.h"

namespace grammar_node {

struct Entry {
  std::shared_ptr<RowState> state;
  void* matcher = nullptr;              // strong reference to xgrammar's GrammarMatcher object (null: none)
  std::shared_ptr<LlgRowMatcher> llg;   // llguidance's native matcher (null: none)
  bool python() const { return !matcher && !llg; }   // a wrapper matcher: the step takes the Python path
};

class Registry {
 public:
  explicit Registry(std::shared_ptr<const Matchers> matchers) : matchers_(std::move(matchers)) {}
  const std::shared_ptr<const Matchers>& matchers() const { return matchers_; }
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;
  ~Registry() {
    for (Entry& e : entries_) release(e);
  }

  int64_t add(std::shared_ptr<RowState> state) {
    if (!state) throw std::invalid_argument("grammar node: a registered row has no state");
    std::lock_guard<std::mutex> lock(mu_);
    int64_t i;
    if (!free_.empty()) {
      i = free_.back();
      free_.pop_back();
    } else {
      i = static_cast<int64_t>(entries_.size());
      entries_.emplace_back();
    }
    entries_[i].state = std::move(state);
    return i;
  }

  // The request's matcher changed (set after compiling, or a wrapper): its handle (0: none) and llguidance's.
  void set_matcher(int64_t i, void* matcher, std::shared_ptr<LlgRowMatcher> llg) {
    std::lock_guard<std::mutex> lock(mu_);
    Entry& e = at(i);
    if (matcher) matchers_->api.object_inc_ref(matcher);
    if (e.matcher) matchers_->api.object_dec_ref(e.matcher);
    e.matcher = matcher;
    e.llg = std::move(llg);
  }

  void remove(int64_t i) {
    std::lock_guard<std::mutex> lock(mu_);
    release(at(i));
    free_.push_back(i);
  }

  size_t live() {
    std::lock_guard<std::mutex> lock(mu_);
    return entries_.size() - free_.size();
  }

  // fn(entry) for each index, under one lock.
  template <typename Fn>
  void each(const int64_t* index, size_t n, Fn&& fn) {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t k = 0; k < n; ++k) fn(k, at(index[k]));
  }

 private:
  Entry& at(int64_t i) {
    if (i < 0 || i >= static_cast<int64_t>(entries_.size()) || !entries_[i].state)
      throw std::out_of_range("grammar node: no registered row " + std::to_string(i));
    return entries_[i];
  }

  void release(Entry& e) {
    if (e.matcher) matchers_->api.object_dec_ref(e.matcher);
    e = Entry{};
  }

  const std::shared_ptr<const Matchers> matchers_;
  std::mutex mu_;
  std::vector<Entry> entries_;
  std::vector<int64_t> free_;
};

}  // namespace grammar_node
