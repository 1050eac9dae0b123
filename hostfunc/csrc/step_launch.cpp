// hostfunc._C.launch_step: a graph step's enqueue in one native call.
//
// The engine's launch of a step is eight CUDA calls around a graph replay: the inputs' upload on the copy-in
// stream, its event, the compute stream's wait for it, the step's start event, the graph, its end event, the
// copy-out stream's wait for that, the sampled tokens' download and its event. Made from Python each is a torch
// call (a tensor slice, a stream context, an event wrapper); here they are plain driver calls on raw handles
// the engine resolved once (engine/runner/native_launch.py). The order and the streams are the Python launch's,
// so the two paths are interchangeable step by step.
//
// The GIL is released for the calls: cuGraphLaunch may block while the device's launch queue is full, and a
// graph's Python host callback (the grammar node's Python path) needs the GIL to finish and drain that queue.
#include "step_launch.h"

#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "driver.h"

namespace py = pybind11;

namespace hostfunc {
namespace {

using Copy = std::tuple<uintptr_t, uintptr_t, size_t>;  // (dst, src, bytes)

template <typename T>
T* as(uintptr_t handle) { return reinterpret_cast<T*>(handle); }

void check(const Driver& d, CUresult rc, const char* what) {
  if (rc != kCudaSuccess) throw std::runtime_error(std::string("launch_step: ") + what + ": " + d.describe(rc));
}

std::string step_launch_error() {
  const Driver& d = driver();
  if (!d.error.empty()) return d.error;
  if (!d.memcpy_htod_async || !d.memcpy_dtoh_async || !d.event_record || !d.stream_wait_event || !d.graph_launch ||
      !d.event_elapsed_time)
    return "the CUDA driver lacks the 12.0 ABI of cuMemcpyHtoDAsync / cuMemcpyDtoHAsync / cuEventRecord / "
           "cuStreamWaitEvent / cuGraphLaunch / cuEventElapsedTime";
  return "";
}

// streams: (copy_in, compute, copy_out); upload: (device, host, bytes); events: (inputs_ready, start,
// sampled_ready, copy_done); downloads: (host, device, bytes) each, none for a step whose tokens stay on the
// device (copy_out and copy_done are then not touched).
void launch_step(std::tuple<uintptr_t, uintptr_t, uintptr_t> streams, Copy upload,
                 std::tuple<uintptr_t, uintptr_t, uintptr_t, uintptr_t> events, uintptr_t graph_exec,
                 const std::vector<Copy>& downloads) {
  if (std::string why = step_launch_error(); !why.empty()) throw std::runtime_error("launch_step: " + why);
  const Driver& d = driver();
  auto [copy_in, compute, copy_out] = streams;
  auto [inputs_ready, start, sampled_ready, copy_done] = events;
  if (!copy_in || !compute || !graph_exec || !inputs_ready || !start || !sampled_ready)
    throw std::invalid_argument("launch_step: a null stream, event or graph handle");
  if (!downloads.empty() && (!copy_out || !copy_done))
    throw std::invalid_argument("launch_step: downloads need the copy-out stream and its event");
  py::gil_scoped_release release;
  auto [dev_in, host_in, in_bytes] = upload;
  if (in_bytes)
    check(d, d.memcpy_htod_async(dev_in, as<const void>(host_in), in_bytes, as<void>(copy_in)), "upload");
  check(d, d.event_record(as<void>(inputs_ready), as<void>(copy_in)), "inputs_ready");
  check(d, d.stream_wait_event(as<void>(compute), as<void>(inputs_ready), 0), "wait for the inputs");
  check(d, d.event_record(as<void>(start), as<void>(compute)), "start");
  check(d, d.graph_launch(as<void>(graph_exec), as<void>(compute)), "graph");
  check(d, d.event_record(as<void>(sampled_ready), as<void>(compute)), "sampled_ready");
  if (downloads.empty()) return;
  check(d, d.stream_wait_event(as<void>(copy_out), as<void>(sampled_ready), 0), "wait for the tokens");
  for (const auto& [host, dev, bytes] : downloads)
    if (bytes) check(d, d.memcpy_dtoh_async(as<void>(host), dev, bytes, as<void>(copy_out)), "download");
  check(d, d.event_record(as<void>(copy_done), as<void>(copy_out)), "copy_done");
}

// Milliseconds from each pair's first event to its second, both recorded with timing and done: the step's device
// times, read at its commit. One call for the pairs, where torch's Event.elapsed_time is a Python wrapper and two
// cudaEventQuery calls before each read.
std::vector<float> event_times(const std::vector<std::pair<uintptr_t, uintptr_t>>& pairs) {
  if (std::string why = step_launch_error(); !why.empty()) throw std::runtime_error("event_times: " + why);
  const Driver& d = driver();
  std::vector<float> out(pairs.size());
  for (size_t i = 0; i < pairs.size(); ++i) {
    auto [first, second] = pairs[i];
    if (!first || !second) throw std::invalid_argument("event_times: a null event handle");
    CUresult rc = d.event_elapsed_time(&out[i], as<void>(first), as<void>(second));
    if (rc != kCudaSuccess)
      throw std::runtime_error("event_times: pair " + std::to_string(i) + ": " + d.describe(rc));
  }
  return out;
}

}  // namespace

void register_step_launch(py::module_& m) {
  m.def("launch_step", &launch_step, py::arg("streams"), py::arg("upload"), py::arg("events"),
        py::arg("graph_exec"), py::arg("downloads"),
        "Enqueue a step: upload, its event, the compute stream's wait, start, the graph, sampled_ready, the "
        "copy-out wait, the downloads and copy_done, on raw handles (engine/runner/native_launch.py).");
  m.def("event_times", &event_times, py::arg("pairs"),
        "Milliseconds between the events of each (first, second) pair of raw handles (cuEventElapsedTime).");
  m.def("step_launch_error", &step_launch_error, "Why launch_step cannot run here ('' when it can).");
}

}  // namespace hostfunc
