// xgrammar matcher calls through tvm-ffi, and the per-request state the grammar node keeps.
//
// Every call is TVMFFIFunctionCall on a method handle of xgrammar's GrammarMatcher type; an exception raised
// inside xgrammar comes back as a non-zero return and an error object, which becomes this request's error
// ("guided decoding failed: <kind>: <message>", the text Python's path writes), never a C++ throw.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "ffi_abi.h"

namespace grammar_node {

constexpr int32_t kAllowAll = -1;  // a mask word allowing its 32 tokens

// The method handles of xgrammar's GrammarMatcher (strong references, held for the process).
struct Matchers {
  FfiApi api;
  void* accept_token = nullptr;             // (self, int token, bool debug) -> bool
  void* fill_next_token_bitmask = nullptr;  // (self, DLTensor*, int index, bool debug) -> bool
  void* rollback = nullptr;                 // (self, int n) -> None
  void* is_terminated = nullptr;            // (self) -> bool
};

struct Call {
  bool ok = true;       // false: the call raised; error says what
  int64_t value = 0;    // its bool / int result
  std::string error;
};

inline std::string describe_error(const FfiApi& api) {
  void* err = nullptr;
  api.error_move_from_raised(&err);
  if (!err) return "unknown error";
  auto* cell = reinterpret_cast<const FfiErrorCell*>(static_cast<const char*>(err) + sizeof(FfiObject));
  std::string text = std::string(cell->kind.data, cell->kind.size) + ": " +
                     std::string(cell->message.data, cell->message.size);
  api.object_dec_ref(err);
  return text;
}

inline Call invoke(const FfiApi& api, void* fn, FfiAny* args, int32_t n) {
  FfiAny out{};
  out.type_index = kNone;
  Call call;
  if (api.function_call(fn, args, n, &out) != 0) {
    call.ok = false;
    call.error = describe_error(api);
    return call;
  }
  if (out.type_index >= kStaticObjectBegin) api.object_dec_ref(out.v_obj);
  else call.value = out.v_int64;
  return call;
}

inline Call accept_token(const Matchers& m, void* matcher, int64_t token) {
  FfiAny args[3] = {any_object(matcher), any_int(token), any_bool(false)};
  return invoke(m.api, m.accept_token, args, 3);
}

inline Call fill_mask(const Matchers& m, void* matcher, DLTensor* bitmask, int64_t index) {
  FfiAny args[4] = {any_object(matcher), any_tensor(bitmask), any_int(index), any_bool(false)};
  return invoke(m.api, m.fill_next_token_bitmask, args, 4);
}

inline Call rollback(const Matchers& m, void* matcher, int64_t n) {
  FfiAny args[2] = {any_object(matcher), any_int(n)};
  return invoke(m.api, m.rollback, args, 2);
}

inline Call is_terminated(const Matchers& m, void* matcher) {
  FfiAny args[1] = {any_object(matcher)};
  return invoke(m.api, m.is_terminated, args, 1);
}

// One guided request's counters, shared by the grammar callbacks (native or Python, one grammar stream, in
// order) and read by the loop thread: `accepted` (output tokens its matcher consumed; the loop thread reads
// it as a lower bound), `through_step` (the last step whose device tokens it accepted), and its first error.
struct RowState {
  std::atomic<int64_t> accepted{0};
  std::atomic<int64_t> through_step{-1};

  bool failed() const { return failed_.load(std::memory_order_acquire); }

  void set_error(std::string message) {  // the first error stays
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_.load(std::memory_order_relaxed)) return;
    error_ = std::move(message);
    failed_.store(true, std::memory_order_release);
  }

  void clear_error() {
    std::lock_guard<std::mutex> lock(mu_);
    error_.clear();
    failed_.store(false, std::memory_order_release);
  }

  std::optional<std::string> error() const {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_.load(std::memory_order_relaxed)) return std::nullopt;
    return error_;
  }

 private:
  mutable std::mutex mu_;
  std::string error_;
  std::atomic<bool> failed_{false};
};

inline std::string failed_message(const std::string& error) { return "guided decoding failed: " + error; }

}  // namespace grammar_node
