// The closing search (closing.h): each step of the walk is a few tvm-ffi calls on the closer's matcher.
#include "closing.h"

#include <stdexcept>

namespace grammar_node {

namespace {

int64_t checked(const Call& c) {
  if (!c.ok) throw std::runtime_error("the closing search's matcher call failed: " + c.error);
  return c.value;
}

bool accept(const ClosingSearch& s, void* matcher, const std::string& text) {
  // a raw C string: closings are JSON text, which holds no NUL byte
  FfiAny args[3] = {any_object(matcher), any_raw_str(text.c_str()), any_bool(false)};
  return checked(invoke(s.api, s.accept_string, args, 3)) != 0;
}

bool completed(const ClosingSearch& s, void* matcher) {
  FfiAny args[1] = {any_object(matcher)};
  return checked(invoke(s.api, s.is_completed, args, 1)) != 0;
}

void roll_back(const ClosingSearch& s, void* matcher, int64_t n) {
  if (n <= 0) return;
  FfiAny args[2] = {any_object(matcher), any_int(n)};
  checked(invoke(s.api, s.rollback, args, 2));
}

// Rolls back the accepted steps when the walk leaves, by return or by throw.
struct Steps {
  const ClosingSearch& s;
  void* matcher;
  int64_t n = 0;
  ~Steps() {
    try {
      roll_back(s, matcher, n);
    } catch (...) {  // a failed rollback leaves the closer broken; its caller turns it off on the first error
    }
  }
};

}  // namespace

std::string jump_forward(const ClosingSearch& s, void* matcher) {
  FfiAny args[1] = {any_object(matcher)};
  FfiAny out{};
  out.type_index = kNone;
  if (s.api.function_call(s.find_jump_forward_string, args, 1, &out) != 0)
    throw std::runtime_error("find_jump_forward_string failed: " + describe_error(s.api));
  return take_string(s.api, out);
}

std::optional<std::string> closing_text(const ClosingSearch& s, void* matcher, size_t limit) {
  std::string out;
  Steps steps{s, matcher};
  while (out.size() <= limit) {
    if (completed(s, matcher)) return out;
    std::string forced = jump_forward(s, matcher);
    if (!forced.empty() && accept(s, matcher, forced)) {
      out += forced;
      ++steps.n;
      continue;
    }
    bool moved = false;
    for (const std::string& byte : s.candidates) {
      if (accept(s, matcher, byte)) {
        out += byte;
        ++steps.n;
        moved = true;
        break;
      }
    }
    if (!moved) return std::nullopt;
  }
  return std::nullopt;
}

std::vector<std::string> branch_closings(const ClosingSearch& s, void* matcher, const std::string& text,
                                         size_t limit) {
  std::vector<size_t> points{0};
  for (size_t i = 0; i < text.size() && points.size() < s.branch_points; ++i)
    if (s.closers.find(text[i]) != std::string::npos) points.push_back(i + 1);
  std::vector<std::string> out;
  for (size_t j : points) {
    Steps prefix{s, matcher};
    if (j) {
      if (!accept(s, matcher, text.substr(0, j))) break;
      prefix.n = 1;
    }
    size_t tries = j == 0 ? s.branches.size() : 1;  // past a closer only a comma opens another item
    for (size_t b = 0; b < tries; ++b) {
      const std::string& branch = s.branches[b];
      if (text.compare(j, branch.size(), branch) == 0 || !accept(s, matcher, branch)) continue;
      Steps taken{s, matcher, 1};
      std::optional<std::string> rest = closing_text(s, matcher, limit);
      if (rest) out.push_back(text.substr(0, j) + branch + *rest);
    }
  }
  return out;
}

}  // namespace grammar_node
