// A small pool of persistent threads for the grammar node: `run(n, fn)` calls fn(i) for every i in [0, n)
// on the calling thread and the workers, and returns when all are done. Rows are independent (each has its
// own matcher), so a step's rows can be processed in any order and in parallel.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace grammar_node {

class Pool {
 public:
  explicit Pool(int threads) : threads_(threads < 1 ? 1 : threads) {}
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;
  ~Pool() { stop(); }

  int threads() const { return threads_; }

  void run(size_t n, const std::function<void(size_t)>& fn) {
    if (threads_ == 1 || n < 2) {
      for (size_t i = 0; i < n; ++i) fn(i);
      return;
    }
    start();
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = &fn;
      n_ = n;
      next_.store(0, std::memory_order_relaxed);
      busy_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    wake_.notify_all();
    drain(fn, n);
    std::unique_lock<std::mutex> lock(mu_);
    idle_.wait(lock, [&] { return busy_ == 0; });
    job_ = nullptr;
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
  }

 private:
  void drain(const std::function<void(size_t)>& fn, size_t n) {
    for (size_t i = next_.fetch_add(1, std::memory_order_relaxed); i < n; i = next_.fetch_add(1, std::memory_order_relaxed))
      fn(i);
  }

  void start() {
    if (!workers_.empty()) return;
    for (int i = 1; i < threads_; ++i) workers_.emplace_back([this] { work(); });
  }

  void work() {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(size_t)>* job;
      size_t n;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
        if (stopping_) return;
        seen = generation_;
        job = job_;
        n = n_;
      }
      drain(*job, n);
      {
        std::lock_guard<std::mutex> lock(mu_);
        --busy_;
      }
      idle_.notify_one();
    }
  }

  const int threads_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable wake_, idle_;
  const std::function<void(size_t)>* job_ = nullptr;
  size_t n_ = 0;
  std::atomic<size_t> next_{0};
  int busy_ = 0;
  uint64_t generation_ = 0;
  bool stopping_ = false;
};

}  // namespace grammar_node
