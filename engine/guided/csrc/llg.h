// llguidance matchers in native code: llguidance's C API (the llg_* functions its Python extension,
// llguidance/_lib.abi3.so, exports), resolved once with dlopen like tvm-ffi's, so the grammar node runs
// llguidance rows on the driver's thread without the GIL, as it runs xgrammar's.
//
// `LlgRowMatcher` gives an llguidance matcher xgrammar's GrammarMatcher semantics (the node and the Python path
// call it the same way): a rejected token leaves the state as it was (llguidance's error state is final, so a
// token is validated before it is consumed), and the stop token is tracked here, never fed to llguidance: the
// matcher terminates once it accepts a stop token where the grammar may end, and rolling that back only
// un-terminates it. One thread at a time per matcher (the grammar callbacks, in order).
#pragma once

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "matcher.h"

namespace grammar_node {

struct LlgTokenizerC;  // llguidance's opaque handles
struct LlgMatcherC;

// llguidance's LlgTokenizerInitV2: the library reads `struct_size` bytes, so fields it added later stay zero.
struct LlgTokenizerInitV2 {
  size_t struct_size;
  uint32_t vocab_size;
  uint32_t tok_eos;
  const uint32_t* token_lens;
  const uint8_t* token_bytes;
  const char* tokenizer_json;
  bool tokenize_assumes_string;
  void* tokenize_fn;
  bool use_approximate_greedy_tokenize_fn;
  const void* tokenize_user_data;
  const char* const* slices;
  const uint32_t* tok_eos_extra;
  uint32_t tok_eos_extra_count;
};

// LlgConstraintInit is filled by llg_constraint_init_set_defaults; only its first fields are ours to set
// (the tokenizer, then the two log levels). A generous buffer: its limits may grow in later versions.
struct LlgConstraintInitBuffer {
  alignas(8) unsigned char bytes[1024] = {};
};

struct LlgApi {
  LlgTokenizerC* (*new_tokenizer_v2)(const LlgTokenizerInitV2*, char*, size_t) = nullptr;
  void (*free_tokenizer)(LlgTokenizerC*) = nullptr;
  void (*init_set_defaults)(void*, const LlgTokenizerC*) = nullptr;
  LlgMatcherC* (*new_matcher)(const void*, const char*, const char*) = nullptr;
  LlgMatcherC* (*clone_matcher)(const LlgMatcherC*) = nullptr;
  void (*free_matcher)(LlgMatcherC*) = nullptr;
  const char* (*get_error)(LlgMatcherC*) = nullptr;
  bool (*is_error)(const LlgMatcherC*) = nullptr;
  int32_t (*compute_mask_into)(LlgMatcherC*, uint32_t*, size_t) = nullptr;
  size_t (*mask_byte_size)(const LlgMatcherC*) = nullptr;
  int32_t (*consume_token)(LlgMatcherC*, uint32_t) = nullptr;
  int32_t (*validate_tokens)(LlgMatcherC*, const uint32_t*, size_t) = nullptr;
  int32_t (*rollback)(LlgMatcherC*, size_t) = nullptr;
  bool (*is_accepting)(LlgMatcherC*) = nullptr;
  size_t (*decode_tokens)(const LlgTokenizerC*, const uint32_t*, size_t, char*, size_t, uint32_t) = nullptr;
};

std::shared_ptr<const LlgApi> load_llg(const std::string& path);  // throws std::runtime_error naming what lacks

// A tokenizer: each token's bytes (special tokens prefixed with 0xFF, so they never match text), the stop ids.
class LlgTokenizer {
 public:
  LlgTokenizer(std::shared_ptr<const LlgApi> api, const std::vector<std::string>& tokens,
               const std::vector<uint32_t>& eos);
  ~LlgTokenizer();
  LlgTokenizer(const LlgTokenizer&) = delete;
  std::string decode(const std::vector<uint32_t>& tokens, bool special) const;  // their bytes, as llguidance sees them
  LlgTokenizer& operator=(const LlgTokenizer&) = delete;

  const std::shared_ptr<const LlgApi> api;
  LlgTokenizerC* handle = nullptr;
  const uint32_t vocab_size;
  const std::vector<uint32_t> eos;
};

class LlgRowMatcher;

// A compiled grammar: a matcher at its start, cloned for each request.
class LlgGrammar {
 public:
  LlgGrammar(std::shared_ptr<const LlgTokenizer> tokenizer, const std::string& grammar);  // ValueError text
  ~LlgGrammar();
  LlgGrammar(const LlgGrammar&) = delete;
  LlgGrammar& operator=(const LlgGrammar&) = delete;
  std::shared_ptr<LlgRowMatcher> matcher() const;

 private:
  std::shared_ptr<const LlgTokenizer> tok_;
  LlgMatcherC* template_ = nullptr;
};

class LlgRowMatcher {
 public:
  LlgRowMatcher(std::shared_ptr<const LlgTokenizer> tokenizer, LlgMatcherC* m) : tok_(std::move(tokenizer)), m_(m) {}
  ~LlgRowMatcher() { tok_->api->free_matcher(m_); }
  LlgRowMatcher(const LlgRowMatcher&) = delete;
  LlgRowMatcher& operator=(const LlgRowMatcher&) = delete;

  // Each returns a Call as xgrammar's matcher calls do (a failure's error: "RuntimeError: llguidance: ...").
  Call accept_token(int64_t token);
  Call fill(int32_t* row, int64_t words);      // one mask row of `words` 32-bit words
  Call rollback(int64_t n);
  bool is_terminated() const { return ended_; }

 private:
  Call failed() const;
  bool is_eos(int64_t token) const { return std::find(tok_->eos.begin(), tok_->eos.end(), token) != tok_->eos.end(); }

  std::shared_ptr<const LlgTokenizer> tok_;
  LlgMatcherC* m_;
  bool ended_ = false;
};

}  // namespace grammar_node
