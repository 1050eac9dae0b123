// The tokens a draft node drafts for a grammar-forced text. The target verifies drafts against what the model
// would emit, and the model emits the tokenizer's own tokenization, which only Python can compute. So a text
// the table has not seen is drafted as the vocabulary's longest match and queued; the loop thread takes the
// queue between steps, tokenizes each text with the tokenizer and teaches the table, and the next time the text
// is forced (a schema's keys come back request after request) it drafts the tokenizer's tokens.
//
// Threads: draft nodes (the driver's thread and the node's pool) read and queue; the loop thread takes and
// teaches. One mutex guards both maps: a lookup is a hash of a short text.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "closing_vocab.h"

namespace grammar_node {

class ForcedTokens {
 public:
  ForcedTokens(std::shared_ptr<const ClosingVocab> vocab, size_t capacity)
      : vocab_(std::move(vocab)), capacity_(capacity) {
    if (!vocab_) throw std::invalid_argument("forced tokens: no vocabulary");
  }

  // The text's tokens: the tokenizer's where taught, else the longest match (and the text queued). Throws
  // std::invalid_argument where no token spells a byte of it.
  std::vector<int64_t> tokens(const std::string& text) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (auto it = known_.find(text); it != known_.end()) return it->second;
      if (asked_.size() < capacity_) asked_.insert(text);
    }
    return vocab_->tokens(text);
  }

  // The texts queued since the last take (loop thread).
  std::vector<std::string> take() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::string> out(asked_.begin(), asked_.end());
    asked_.clear();
    return out;
  }

  // The tokenizer's tokens of `text` (loop thread). A full table starts over.
  void teach(const std::string& text, std::vector<int64_t> tokens) {
    std::lock_guard<std::mutex> lock(mu_);
    if (known_.size() >= capacity_) known_.clear();
    known_[text] = std::move(tokens);
  }

  size_t known() {
    std::lock_guard<std::mutex> lock(mu_);
    return known_.size();
  }

 private:
  const std::shared_ptr<const ClosingVocab> vocab_;
  const size_t capacity_;
  std::mutex mu_;
  std::unordered_map<std::string, std::vector<int64_t>> known_;
  std::unordered_set<std::string> asked_;
};

}  // namespace grammar_node
