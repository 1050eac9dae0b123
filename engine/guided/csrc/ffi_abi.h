// The few pieces of the tvm-ffi C ABI the grammar node calls xgrammar's matchers through.
//
// xgrammar's GrammarMatcher is a tvm-ffi object whose methods are tvm-ffi Function objects (its type info
// lists them; Python hands us their handles). Calling one is TVMFFIFunctionCall(func, args, n, &result):
// plain C, no interpreter, no GIL. The layouts below are tvm-ffi's stable C ABI (c_api.h, version 0.1),
// declared here so the extension builds without tvm-ffi's headers; libtvm_ffi.so is dlopen'ed at run time
// from the path the Python side finds (the library xgrammar already loaded).
#pragma once

#include <dlfcn.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace grammar_node {

// DLPack (v1) tensor, for the bitmask argument of fill_next_token_bitmask.
struct DLDevice { int32_t device_type; int32_t device_id; };
struct DLDataType { uint8_t code; uint8_t bits; uint16_t lanes; };
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
constexpr int32_t kDLCPU = 1;
constexpr uint8_t kDLInt = 0;

struct FfiObject {  // TVMFFIObject: the header of every heap object
  uint64_t combined_ref_count;
  int32_t type_index;
  uint32_t padding;
  void* deleter;
};

struct FfiAny {  // TVMFFIAny: 16 bytes
  int32_t type_index;
  uint32_t zero_padding;  // a small string's length (kSmallStr), else zero
  union {
    int64_t v_int64;
    double v_float64;
    void* v_ptr;
    FfiObject* v_obj;
  };
};

struct FfiByteArray { const char* data; size_t size; };
struct FfiErrorCell { FfiByteArray kind; FfiByteArray message; };  // follows the error object's header

constexpr int32_t kNone = 0, kInt = 1, kBool = 2, kDLTensorPtr = 7, kRawStr = 8, kSmallStr = 11;
constexpr int32_t kStaticObjectBegin = 64, kStr = 65;

struct FfiApi {
  int (*function_call)(void* func, FfiAny* args, int32_t num_args, FfiAny* result) = nullptr;
  void (*error_move_from_raised)(void** result) = nullptr;
  int (*object_inc_ref)(void* obj) = nullptr;
  int (*object_dec_ref)(void* obj) = nullptr;
  std::string error;  // why it is unusable; empty once loaded
};

inline FfiApi load_ffi(const std::string& path) {
  FfiApi api;
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* why = dlerror();
    api.error = "cannot load " + path + ": " + (why ? why : "unknown reason");
    return api;
  }
  api.function_call = reinterpret_cast<decltype(api.function_call)>(dlsym(lib, "TVMFFIFunctionCall"));
  api.error_move_from_raised =
      reinterpret_cast<decltype(api.error_move_from_raised)>(dlsym(lib, "TVMFFIErrorMoveFromRaised"));
  api.object_inc_ref = reinterpret_cast<decltype(api.object_inc_ref)>(dlsym(lib, "TVMFFIObjectIncRef"));
  api.object_dec_ref = reinterpret_cast<decltype(api.object_dec_ref)>(dlsym(lib, "TVMFFIObjectDecRef"));
  if (!api.function_call || !api.error_move_from_raised || !api.object_inc_ref || !api.object_dec_ref)
    api.error = path + " lacks the tvm-ffi C API (TVMFFIFunctionCall, TVMFFIErrorMoveFromRaised, refcounts)";
  return api;
}

inline FfiAny any_int(int64_t v) { FfiAny a{}; a.type_index = kInt; a.v_int64 = v; return a; }
inline FfiAny any_bool(bool v) { FfiAny a{}; a.type_index = kBool; a.v_int64 = v; return a; }
inline FfiAny any_raw_str(const char* text) {  // NUL-terminated, borrowed for the call
  FfiAny a{};
  a.type_index = kRawStr;
  a.v_ptr = const_cast<char*>(text);
  return a;
}
inline FfiAny any_tensor(DLTensor* t) { FfiAny a{}; a.type_index = kDLTensorPtr; a.v_ptr = t; return a; }
inline FfiAny any_object(void* obj) {  // a borrowed view: the type index is the object's own
  FfiAny a{};
  a.v_obj = static_cast<FfiObject*>(obj);
  a.type_index = a.v_obj->type_index;
  return a;
}

// A function's string result: a small string inline (up to 7 bytes), or a String object, whose reference the
// caller owns (it is released here). Anything else is "".
inline std::string take_string(const FfiApi& api, const FfiAny& out) {
  if (out.type_index == kSmallStr)
    return std::string(reinterpret_cast<const char*>(&out.v_int64), out.zero_padding);
  if (out.type_index < kStaticObjectBegin) return std::string();
  std::string text;
  if (out.type_index == kStr) {
    auto* cell = reinterpret_cast<const FfiByteArray*>(reinterpret_cast<const char*>(out.v_obj) + sizeof(FfiObject));
    text.assign(cell->data, cell->size);
  }
  api.object_dec_ref(out.v_obj);
  return text;
}

}  // namespace grammar_node
