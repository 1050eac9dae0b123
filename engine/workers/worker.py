"""A tensor-parallel worker: rank r >= 1 in a process of its own, one GPU (or a CPU share) each; started by
engine/workers/cluster.py as `python -m engine.workers.worker` with its WorkerSpec pickled on stdin.

It builds the same ModelRunner as rank 0 over its shard of the model (its graphs captured in the same order,
so the collectives inside them pair up), then launches every step rank 0 sends it, until told to stop. It
reads no tokens back and runs no grammar: rank 0 plans, and broadcasts masks and drafts inside the step.
It exits when its parent does (no orphans), and reports an exception through the store before it dies.
"""
from __future__ import annotations

import datetime
import os
import pickle
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.models.loader import ModelSource


@dataclass(frozen=True)
class WorkerSpec:
    config: EngineConfig        # rank 0's, with this rank's device
    source: ModelSource
    draft: ModelSource | None   # a draft model's source (speculative="draft_model")
    max_model_len: int
    rank: int
    world: int
    port: int                   # rank 0's TCPStore
    backend: str                # "nccl" | "gloo"
    has_encode: bool            # rank 0 has a tokenizer (guided forced drafts are built on every rank or none)


def worker_main(spec: WorkerSpec) -> None:
    _exit_with_parent(os.getppid())
    c = spec.config
    store = dist.TCPStore("127.0.0.1", spec.port, spec.world, is_master=False,
                          timeout=datetime.timedelta(seconds=c.tuning.tp_timeout_s))
    try:
        _serve(spec, store)
    except BaseException as exc:
        store.set(f"error/{spec.rank}", f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
        os._exit(1)


def _serve(spec: WorkerSpec, store) -> None:
    from engine.parallel.group import DistGroup
    from engine.runner.model_runner import ModelRunner
    from engine.workers.channel import StepChannel
    c = spec.config
    device = c.torch_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world))
    store.set(f"hello/{spec.rank}", str(os.getpid()))
    group = DistGroup(store, spec.rank, spec.world, spec.backend, c.tuning.tp_timeout_s)
    encode = _no_encode if spec.has_encode else None
    runner = ModelRunner(c, spec.source, spec.max_model_len, encode, tp=group, draft=spec.draft)
    channel = StepChannel(group)
    before_write = _upload_done(runner)
    while (step := channel.receive(runner.slots, before_write)) is not None:
        slot, step_index, greedy, guided = step
        runner.launch(slot, step_index, greedy, guided=guided, download=False)
    runner.close()


def _upload_done(runner):
    """The slot's host buffer may be written once its last upload has run (CUDA; on the CPU it has)."""
    if not runner.cuda:
        return lambda slot: None
    return lambda slot: runner.slot_events[slot.index]["inputs_ready"].synchronize()


def _no_encode(text: str):
    raise RuntimeError("tensor-parallel workers run no grammar")


def _exit_with_parent(parent: int) -> None:
    """A worker whose engine process is gone exits (it may be blocked in a collective that never ends)."""
    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)
    threading.Thread(target=watch, name="specdec-tp-parent", daemon=True).start()


if __name__ == "__main__":
    worker_main(pickle.load(sys.stdin.buffer))
