// The repetition guard's scan (engine/guided/closing.py repetition_scan_py) over plain arrays: the grammar
// extension's repetition_scan and the host path's native commit (engine/requests/csrc/hostpath.cpp) both run it.
#pragma once

#include <algorithm>
#include <cstddef>

namespace repetition {

constexpr int FIRED = 1, WATCH = 2, WOKE = 4;

// tok[i] for i in [start - periods, n) (earlier entries unread), run: periods + 1 counters, updated in place.
// Returns FIRED (runs cleared), or WATCH (the last token's state) | WOKE (some token set watch).
inline int scan(const long* tok, size_t n, size_t start, long* run, size_t periods, long limit, long watch_from,
                bool watch) {
  int result = 0;
  bool any_run = false;
  for (size_t p = 1; p <= periods; ++p) any_run = any_run || run[p];
  for (size_t i = start; i < n; ++i) {
    bool period_ends = false;
    for (size_t j = i > periods ? i - periods : 0; j < i && !period_ends; ++j) period_ends = tok[j] == tok[i];
    if (!period_ends) {
      if (watch || any_run) std::fill(run, run + periods + 1, 0), watch = any_run = false;
      continue;
    }
    long longest = 0;
    any_run = false;
    for (size_t p = 1; p <= periods; ++p) {
      run[p] = i >= p && tok[i] == tok[i - p] ? run[p] + 1 : 0;
      if (run[p]) longest = std::max(longest, run[p] + static_cast<long>(p)), any_run = true;
    }
    if (longest >= limit) {
      std::fill(run, run + periods + 1, 0);
      return FIRED;
    }
    watch = longest >= watch_from;
    if (watch) result |= WOKE;
  }
  return result | (watch ? WATCH : 0);
}

}  // namespace repetition
