"""A graph step's enqueue in one native call (hostfunc._C.launch_step, hostfunc/csrc/step_launch.cpp).

ModelRunner.launch's CUDA work for a step is an upload on the copy-in stream, four event records, two stream waits,
the graph's replay and the token download on the copy-out stream: nine torch calls, each a Python wrapper with its
own cost on the host. At one stream a small model's host launch is then a large share of its step, and the replay
itself a small part of the launch (docs/pipeline.md). This makes the same calls, in the same order on the same
streams, from C++ on handles resolved once: the streams, the events (made on their first record, so recorded once
here), each graph's exec handle (StepGraphs.exec_handle) and the slots' buffers (DecodeSlot.raw_copies).

Steps that write penalty, bias or n-gram history state before their graph (torch calls on the compute stream)
keep the Python launch, as eager steps do; the two paths interleave freely.
"""
from __future__ import annotations

import time
import warnings

import torch

from hostfunc import _C


def unavailable() -> str:
    """Why the native launch cannot run here ('' when it can)."""
    if not hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec"):
        return f"torch {torch.__version__} does not give a CUDA graph's exec handle (raw_cuda_graph_exec)"
    return _C.step_launch_error()


def for_runner(runner, enabled: bool) -> NativeLaunch | None:
    """The runner's native launch: None where it has no graph steps to take or `enabled` is off. On by default,
    so where it cannot run (an older torch, a driver without the entry points) the engine warns once and keeps
    the Python launch: the same steps, only a slower host."""
    if not enabled or runner.graphs is None:
        return None
    why = unavailable()
    if why:
        warnings.warn(f"native_launch cannot run here ({why}); graph steps use the Python launch", stacklevel=2)
        return None
    return NativeLaunch(runner)


class NativeLaunch:
    def __init__(self, runner):
        why = unavailable()
        if why:
            raise RuntimeError(f"native_launch is on but cannot run here: {why}")
        self.graphs = runner.graphs
        self.streams = tuple(s.cuda_stream for s in (runner.copy_in_stream, runner.compute_stream,
                                                    runner.copy_out_stream))
        for events in (*runner.slot_events, *runner.step_events):
            for event in events.values():
                event.record(runner.compute_stream)     # a torch event makes its CUDA event on first record
        runner.compute_stream.synchronize()
        self.slot_events = [(ev["inputs_ready"].cuda_event, ev["copy_done"].cuda_event) for ev in runner.slot_events]
        self.step_events = [(te["start"].cuda_event, te["sampled_ready"].cuda_event) for te in runner.step_events]

    @staticmethod
    def takes(slot) -> bool:
        """Whether this launch can take the slot's step: a graph step with no state written before it."""
        return slot.graph_key is not None and not (slot.bias_writes or slot.span_writes or slot.history_writes or
                                                 slot.vocab_writes)

    @staticmethod
    def elapsed_ms(pairs) -> list[float]:
        """Each (first, second) torch event pair's milliseconds, in one driver call (no cudaEventQuery pair and
        Python wrapper a read, as Event.elapsed_time has)."""
        return _C.event_times([(first.cuda_event, second.cuda_event) for first, second in pairs])

    def launch(self, slot, step_index: int, variant, padded: int, download: bool) -> float:
        """Enqueue the step as ModelRunner.launch's Python path would; returns the call's host seconds."""
        t0 = time.perf_counter()
        inputs_ready, copy_done = self.slot_events[slot.index]
        start, sampled_ready = self.step_events[step_index % len(self.step_events)]
        upload, downloads = slot.raw_copies(padded)
        _C.launch_step(self.streams if download else self.streams[:2] + (0,), upload,
                       (inputs_ready, start, sampled_ready, copy_done if download else 0),
                       self.graphs.exec_handle(slot, variant), downloads if download else [])
        return time.perf_counter() - t0
