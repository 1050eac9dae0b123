// Run-time binding of the few CUDA driver entry points hostfunc needs.
//
// The types are declared here (CUDA 12.0 ABI) so the extension builds with no CUDA toolkit; libcuda.so.1 is
// dlopen'ed on first use. Entry points come from cuGetProcAddress_v2 with cudaVersion 12000, which pins the
// ABI of versioned symbols (cuStreamGetCaptureInfo is the 6-argument _v2 there, whatever the driver's own
// default is, e.g. _v3 on CUDA 13), and the legacy-default-stream variants (torch's stream 0).
#pragma once

#include <dlfcn.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace hostfunc {

using CUresult = int;
using CUstream = void*;
using CUcontext = void*;
using CUhostFn = void (*)(void*);
using CUevent = void*;
using CUgraphExec = void*;
using CUdeviceptr = unsigned long long;
constexpr CUresult kCudaSuccess = 0;
constexpr int kCaptureStatusNone = 0;  // CU_STREAM_CAPTURE_STATUS_NONE

struct Driver {
  CUresult (*launch_host_func)(CUstream, CUhostFn, void*) = nullptr;
  CUresult (*stream_is_capturing)(CUstream, int*) = nullptr;
  // cuStreamGetCaptureInfo, _v2 ABI: (stream, status, id, graph, deps, num_deps); optional.
  CUresult (*get_capture_info)(CUstream, int*, uint64_t*, void**, const void***, size_t*) = nullptr;
  CUresult (*get_error_string)(CUresult, const char**) = nullptr;
  CUresult (*get_error_name)(CUresult, const char**) = nullptr;
  CUresult (*ctx_get_current)(CUcontext*) = nullptr;
  CUresult (*ctx_set_current)(CUcontext) = nullptr;
  CUresult (*stream_get_ctx)(CUstream, CUcontext*) = nullptr;
  // a step's native launch (step_launch.cpp); null where the driver predates the pinned 12.0 ABI
  CUresult (*memcpy_htod_async)(CUdeviceptr, const void*, size_t, CUstream) = nullptr;
  CUresult (*memcpy_dtoh_async)(void*, CUdeviceptr, size_t, CUstream) = nullptr;
  CUresult (*event_record)(CUevent, CUstream) = nullptr;
  CUresult (*stream_wait_event)(CUstream, CUevent, unsigned) = nullptr;
  CUresult (*graph_launch)(CUgraphExec, CUstream) = nullptr;
  CUresult (*event_elapsed_time)(float*, CUevent, CUevent) = nullptr;
  std::string error;  // why the driver is unusable; empty when it loaded

  std::string describe(CUresult rc) const {
    const char* name = nullptr;
    const char* text = nullptr;
    if (get_error_name) get_error_name(rc, &name);
    if (get_error_string) get_error_string(rc, &text);
    return std::string(name ? name : "CUDA error") + " (" + std::to_string(rc) + "): " + (text ? text : "unknown");
  }
};

namespace detail {

using GetProcV2 = CUresult (*)(const char*, void**, int, uint64_t, int*);
constexpr int kAbiVersion = 12000;
constexpr uint64_t kLegacyStream = 1;  // CU_GET_PROC_ADDRESS_LEGACY_STREAM

template <typename F>
void bind(F& slot, void* fn) { slot = reinterpret_cast<F>(fn); }

inline std::string load(Driver& d) {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* why = dlerror();
    return std::string("libcuda.so.1 could not be loaded (") + (why ? why : "unknown reason") +
           "): no NVIDIA driver on this machine";
  }
  auto init = reinterpret_cast<CUresult (*)(unsigned)>(dlsym(lib, "cuInit"));
  auto version = reinterpret_cast<CUresult (*)(int*)>(dlsym(lib, "cuDriverGetVersion"));
  bind(d.get_error_string, dlsym(lib, "cuGetErrorString"));
  bind(d.get_error_name, dlsym(lib, "cuGetErrorName"));
  if (!init || !version) return "libcuda.so.1 lacks cuInit/cuDriverGetVersion";
  if (CUresult rc = init(0); rc != kCudaSuccess) return "cuInit failed: " + d.describe(rc) + " (no usable GPU?)";
  int driver_version = 0;
  version(&driver_version);
  auto get_proc = reinterpret_cast<GetProcV2>(dlsym(lib, "cuGetProcAddress_v2"));
  bool pinned_abi = get_proc && driver_version >= kAbiVersion;
  auto resolve = [&](const char* name) -> void* {
    if (!pinned_abi) return dlsym(lib, name);  // unversioned exports keep their original ABI
    void* fn = nullptr;
    int status = 0;
    CUresult rc = get_proc(name, &fn, kAbiVersion, kLegacyStream, &status);
    return rc == kCudaSuccess && status == 0 ? fn : nullptr;
  };
  bind(d.launch_host_func, resolve("cuLaunchHostFunc"));
  bind(d.stream_is_capturing, resolve("cuStreamIsCapturing"));
  bind(d.ctx_get_current, resolve("cuCtxGetCurrent"));
  bind(d.ctx_set_current, resolve("cuCtxSetCurrent"));
  bind(d.stream_get_ctx, resolve("cuStreamGetCtx"));
  // The plain exports are v1 ABIs (cuStreamGetCaptureInfo's 3 arguments, 32-bit device pointers), so only take
  // these through the pinned-ABI path.
  if (pinned_abi) {
    bind(d.get_capture_info, resolve("cuStreamGetCaptureInfo"));
    bind(d.memcpy_htod_async, resolve("cuMemcpyHtoDAsync"));
    bind(d.memcpy_dtoh_async, resolve("cuMemcpyDtoHAsync"));
    bind(d.event_record, resolve("cuEventRecord"));
    bind(d.stream_wait_event, resolve("cuStreamWaitEvent"));
    bind(d.graph_launch, resolve("cuGraphLaunch"));
    bind(d.event_elapsed_time, resolve("cuEventElapsedTime"));
  }
  if (!d.launch_host_func || !d.stream_is_capturing)
    return "driver " + std::to_string(driver_version) + " lacks cuLaunchHostFunc/cuStreamIsCapturing";
  return "";
}

}  // namespace detail

// Loaded once, thread-safely (C++11 static initialisation); check .error before use.
inline const Driver& driver() {
  static const Driver d = [] {
    Driver out;
    out.error = detail::load(out);
    return out;
  }();
  return d;
}

}  // namespace hostfunc
