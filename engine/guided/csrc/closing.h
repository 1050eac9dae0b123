// A guided output's closing, searched in native code: the same greedy walk as engine/guided/closing.py's
// closing_text and branch_closings (the Python functions are the reference and the fallback), with each matcher
// call made through tvm-ffi instead of the interpreter. The loop thread calls it on a closer's own matcher,
// which no grammar callback touches.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "matcher.h"

namespace grammar_node {

// xgrammar GrammarMatcher methods the search calls (strong references, held for the process), and the search's
// constants as closing.py gives them.
struct ClosingSearch {
  FfiApi api;
  void* accept_string = nullptr;             // (self, str, bool debug) -> bool
  void* find_jump_forward_string = nullptr;  // (self) -> str
  void* is_completed = nullptr;              // (self) -> bool
  void* rollback = nullptr;                  // (self, int n) -> None
  std::vector<std::string> candidates;       // bytes tried in order where the grammar forces nothing
  std::vector<std::string> branches;         // bytes that open another item (the first: the comma)
  std::string closers;                       // bytes that close a string, array or object
  size_t branch_points = 0;                  // places along a closing where branches are tried
};

// A continuation after which the matcher's grammar is complete ("" if it is already); nullopt if the walk finds
// none within `limit` bytes. The matcher is left as it was. Throws std::runtime_error if a matcher call fails.
std::optional<std::string> closing_text(const ClosingSearch& s, void* matcher, size_t limit);

// The matcher's jump-forward string: the text its grammar allows alone from here ("" where it allows more than
// one continuation). Throws std::runtime_error if the matcher call fails.
std::string jump_forward(const ClosingSearch& s, void* matcher);

// The closings through a branch off `text` (the closing from the matcher's state). The matcher is left as it was.
std::vector<std::string> branch_closings(const ClosingSearch& s, void* matcher, const std::string& text,
                                         size_t limit);

}  // namespace grammar_node
