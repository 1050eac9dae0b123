// A closing text's tokens (engine/guided/closing_search.py ClosingVocab, whose `python_tokens` is the reference):
// longest match over the vocabulary's byte strings, each match stopping where its text is no proper prefix of a
// token. Immutable once built; a closer asks it on the loop thread.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace grammar_node {

class ClosingVocab {
 public:
  ClosingVocab(const std::vector<std::string>& pieces, const std::vector<int64_t>& ids) {
    if (pieces.size() != ids.size()) throw std::invalid_argument("closing vocab: one id a piece");
    ids_.reserve(pieces.size());
    for (size_t i = 0; i < pieces.size(); ++i) {
      if (pieces[i].empty()) continue;
      ids_.emplace(pieces[i], ids[i]);
      for (size_t j = 1; j < pieces[i].size(); ++j) prefixes_.insert(pieces[i].substr(0, j));
    }
  }

  std::vector<int64_t> tokens(const std::string& text) const {
    std::vector<int64_t> out;
    size_t i = 0;
    while (i < text.size()) {
      int64_t best = 0;
      size_t size = 0;
      for (size_t n = 1; i + n <= text.size(); ++n) {
        const std::string piece = text.substr(i, n);
        if (auto it = ids_.find(piece); it != ids_.end()) best = it->second, size = n;
        if (!prefixes_.count(piece)) break;
      }
      if (!size) throw std::invalid_argument("no token spells byte " + std::to_string(static_cast<uint8_t>(text[i])));
      out.push_back(best);
      i += size;
    }
    return out;
  }

 private:
  std::unordered_map<std::string, int64_t> ids_;
  std::unordered_set<std::string> prefixes_;
};

}  // namespace grammar_node
