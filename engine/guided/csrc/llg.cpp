// llguidance matchers through its C API (see llg.h).
#include "llg.h"

namespace grammar_node {

namespace {

template <typename F>
void bind(void* lib, const char* name, F& fn, std::string& missing) {
  fn = reinterpret_cast<F>(dlsym(lib, name));
  if (!fn) missing += std::string(missing.empty() ? "" : ", ") + name;
}

}  // namespace

std::shared_ptr<const LlgApi> load_llg(const std::string& path) {
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);  // already loaded by Python: this finds it
  if (!lib) {
    const char* why = dlerror();
    throw std::runtime_error("cannot load " + path + ": " + (why ? why : "unknown reason"));
  }
  auto api = std::make_shared<LlgApi>();
  std::string missing;
  bind(lib, "llg_new_tokenizer_v2", api->new_tokenizer_v2, missing);
  bind(lib, "llg_free_tokenizer", api->free_tokenizer, missing);
  bind(lib, "llg_constraint_init_set_defaults", api->init_set_defaults, missing);
  bind(lib, "llg_new_matcher", api->new_matcher, missing);
  bind(lib, "llg_clone_matcher", api->clone_matcher, missing);
  bind(lib, "llg_free_matcher", api->free_matcher, missing);
  bind(lib, "llg_matcher_get_error", api->get_error, missing);
  bind(lib, "llg_matcher_is_error", api->is_error, missing);
  bind(lib, "llg_matcher_compute_mask_into", api->compute_mask_into, missing);
  bind(lib, "llg_matcher_get_mask_byte_size", api->mask_byte_size, missing);
  bind(lib, "llg_matcher_consume_token", api->consume_token, missing);
  bind(lib, "llg_matcher_validate_tokens", api->validate_tokens, missing);
  bind(lib, "llg_matcher_rollback", api->rollback, missing);
  bind(lib, "llg_matcher_is_accepting", api->is_accepting, missing);
  bind(lib, "llg_decode_tokens", api->decode_tokens, missing);
  if (!missing.empty()) throw std::runtime_error(path + " lacks llguidance's C API: " + missing);
  return api;
}

LlgTokenizer::LlgTokenizer(std::shared_ptr<const LlgApi> api_, const std::vector<std::string>& tokens,
                           const std::vector<uint32_t>& eos_)
    : api(std::move(api_)), vocab_size(static_cast<uint32_t>(tokens.size())), eos(eos_) {
  if (eos.empty()) throw std::invalid_argument("llguidance tokenizer: no stop token");
  std::vector<uint32_t> lens;
  std::string bytes;
  lens.reserve(tokens.size());
  for (const std::string& t : tokens) {
    lens.push_back(static_cast<uint32_t>(t.size()));
    bytes += t;
  }
  LlgTokenizerInitV2 init{};
  init.struct_size = sizeof(init);
  init.vocab_size = vocab_size;
  init.tok_eos = eos[0];
  init.token_lens = lens.data();
  init.token_bytes = reinterpret_cast<const uint8_t*>(bytes.data());
  // No tokenize function: it would be Python's (the GIL). Masks do not use it; llguidance then computes no
  // forced tokens (its tokenization is not canonical), so its rows draft no forced text.
  init.use_approximate_greedy_tokenize_fn = true;
  init.tok_eos_extra = eos.size() > 1 ? eos.data() + 1 : nullptr;
  init.tok_eos_extra_count = static_cast<uint32_t>(eos.size() - 1);
  char error[1024] = {};
  handle = api->new_tokenizer_v2(&init, error, sizeof(error));
  if (!handle) throw std::invalid_argument(std::string("llguidance tokenizer: ") + error);
}

LlgTokenizer::~LlgTokenizer() { api->free_tokenizer(handle); }

std::string LlgTokenizer::decode(const std::vector<uint32_t>& tokens, bool special) const {
  std::string out(64, '\0');
  for (int tries = 0; tries < 2; ++tries) {  // the second with the length the first reported
    size_t n = api->decode_tokens(handle, tokens.data(), tokens.size(), out.data(), out.size(), special ? 1 : 0);
    if (n <= out.size()) {  // n counts the terminating NUL (a token may hold a NUL byte of its own)
      out.resize(n > 0 ? n - 1 : 0);
      return out;
    }
    out.assign(n, '\0');
  }
  return out;
}

LlgGrammar::LlgGrammar(std::shared_ptr<const LlgTokenizer> tokenizer, const std::string& grammar)
    : tok_(std::move(tokenizer)) {
  const LlgApi& api = *tok_->api;
  LlgConstraintInitBuffer init;
  api.init_set_defaults(init.bytes, tok_->handle);
  uint32_t quiet[2] = {0, 0};  // log_buffer_level, log_stderr_level: after the tokenizer pointer
  std::memcpy(init.bytes + sizeof(void*), quiet, sizeof(quiet));
  template_ = api.new_matcher(init.bytes, "llguidance", grammar.c_str());
  if (api.is_error(template_)) {
    std::string why = api.get_error(template_);
    api.free_matcher(template_);
    throw std::invalid_argument("llguidance: " + why);
  }
}

LlgGrammar::~LlgGrammar() { tok_->api->free_matcher(template_); }

std::shared_ptr<LlgRowMatcher> LlgGrammar::matcher() const {
  return std::make_shared<LlgRowMatcher>(tok_, tok_->api->clone_matcher(template_));
}

Call LlgRowMatcher::failed() const {
  const char* why = tok_->api->get_error(m_);
  return Call{false, 0, std::string("RuntimeError: llguidance: ") + (why ? why : "unknown error")};
}

Call LlgRowMatcher::accept_token(int64_t token) {
  const LlgApi& api = *tok_->api;
  if (api.is_error(m_)) return failed();
  if (ended_ || token < 0 || token >= tok_->vocab_size) return Call{true, 0, {}};
  if (is_eos(token)) {
    ended_ = api.is_accepting(m_);
    return Call{true, ended_, {}};
  }
  uint32_t t = static_cast<uint32_t>(token);
  int32_t valid = api.validate_tokens(m_, &t, 1);
  if (valid < 0) return failed();
  if (valid == 0) return Call{true, 0, {}};
  if (api.consume_token(m_, t) != 0) return failed();
  return Call{true, 1, {}};
}

Call LlgRowMatcher::fill(int32_t* row, int64_t words) {
  const LlgApi& api = *tok_->api;
  size_t size = api.mask_byte_size(m_);
  size_t room = static_cast<size_t>(words) * sizeof(int32_t);
  if (size > room)
    return Call{false, 0, "ValueError: llguidance's mask (" + std::to_string(size) +
                                     " bytes) is wider than the row (" + std::to_string(room) + ")"};
  if (api.compute_mask_into(m_, reinterpret_cast<uint32_t*>(row), size) != 0) return failed();
  std::memset(reinterpret_cast<char*>(row) + size, 0, room - size);  // ids past llguidance's vocabulary
  return Call{true, 1, {}};
}

Call LlgRowMatcher::rollback(int64_t n) {
  if (n > 0 && ended_) {
    ended_ = false;
    --n;
  }
  if (n > 0 && tok_->api->rollback(m_, static_cast<size_t>(n)) != 0) return failed();
  return Call{true, 0, {}};
}

}  // namespace grammar_node
