"""Rank 0's side of tensor parallelism: starts the workers, owns the groups, and ends the engine when a
worker dies or hangs.

Workers are fresh interpreters (`python -m engine.workers.worker`, their spec pickled on stdin: unlike
multiprocessing's spawn this re-imports no caller's script, so one needs no `__main__` guard) that meet rank 0
at a TCPStore on a free port. A watchdog thread polls them; while the engine thread is inside a step (`watch()`),
a step that takes longer than `tp_timeout_s` counts as a hang. Either way the groups are aborted (a collective
blocked on the lost rank returns, NCCL kernels in a graph included), every worker is killed, and the
engine raises TensorParallelError naming what happened (and the worker's own exception if it reported one).
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import os
import pickle
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from engine.parallel.group import DistGroup, TensorParallelError
from engine.parallel.sharding import param_shards
from engine.runner.model_runner import ModelRunner
from engine.workers.channel import StepChannel
from engine.workers.worker import WorkerSpec


def start_ranks(config, source, draft, max_model_len: int, encode):
    """(rank 0's ModelRunner, the Cluster of the other ranks) for tensor_parallel_size > 1; `draft`: the draft
    model's source, resolved once for every rank."""
    param_shards(source.config, 0, config.tensor_parallel_size)     # a model that cannot be cut: say so now
    cluster = Cluster(config, source, draft, max_model_len, has_encode=encode is not None)
    try:
        with cluster.watch(timed=False):
            runner = ModelRunner(config, source, max_model_len, encode, tp=cluster.group, draft=draft)
    except BaseException:
        cluster.close()
        raise
    return runner, cluster


class Cluster:
    def __init__(self, config, source, draft, max_model_len: int, has_encode: bool):
        self.world, self.timeout = config.tensor_parallel_size, config.tuning.tp_timeout_s
        backend, devices = _placement(config)
        self.failure: str | None = None
        self._lock, self._closing = threading.Lock(), threading.Event()
        self._inside_since: float | None = None
        self.store = dist.TCPStore("127.0.0.1", 0, self.world, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=self.timeout))
        print(f"specdec: starting {self.world - 1} tensor-parallel worker(s) ({backend})", file=sys.stderr)
        self.workers = [_start(WorkerSpec(dataclasses.replace(config, device=devices[r]), source, draft, max_model_len,
                                          r, self.world, self.store.port, backend, has_encode))
                        for r in range(1, self.world)]
        atexit.register(_close_at_exit, weakref.ref(self))
        self._watchdog = threading.Thread(target=self._watch, name="specdec-tp-watchdog", daemon=True)
        self._watchdog.start()
        try:
            with self.watch(timed=False):
                self._await_workers()
                self.group = DistGroup(self.store, 0, self.world, backend, self.timeout)
        except BaseException:
            self.close()
            raise
        self.channel = StepChannel(self.group)

    # ---- failure -----------------------------------------------------------------------------
    def check(self) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)

    @contextlib.contextmanager
    def watch(self, timed: bool = True):
        """Around the engine's work with the workers: a lost worker, or (timed) a hang past the timeout, ends
        the engine, and any exception inside (the ranks are now out of step) is fatal too. Start-up (loading,
        graph capture) is not timed: a large model takes as long as it takes."""
        self.check()
        self._inside_since = time.monotonic() if timed else None
        try:
            yield
        except TensorParallelError:
            raise
        except Exception as exc:
            # a collective fails when its peer dies: name the dead worker if that is what happened
            self.fail(self._lost_worker(wait=1.0) or f"{type(exc).__name__}: {exc}")
            raise TensorParallelError(self.failure) from exc
        finally:
            self._inside_since = None
        self.check()

    def fail(self, message: str) -> None:
        """Record the first failure, abort the groups and kill the workers (any thread)."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = f"tensor parallelism failed: {message}"
        group = getattr(self, "group", None)
        if group is not None:
            group.abort()
        self._kill()

    def _lost_worker(self, wait: float = 0.0) -> str | None:
        """What happened to the first worker that exited (within `wait` seconds), or None."""
        deadline = time.monotonic() + wait
        while True:
            for rank, p in enumerate(self.workers, 1):
                if p.poll() is not None:
                    return f"worker {rank} (pid {p.pid}) exited with code {p.returncode}{self._reported(rank)}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def _watch(self) -> None:
        while not self._closing.wait(0.1) and self.failure is None:
            lost = self._lost_worker()
            if lost and not self._closing.is_set():
                self.fail(lost)
                return
            since = self._inside_since
            if since is not None and time.monotonic() - since > self.timeout:
                self.fail(f"a step did not finish within tp_timeout_s={self.timeout:g}s (a worker hung)")

    def _reported(self, rank: int) -> str:
        try:
            if self.store.check([f"error/{rank}"]):
                return f": {self.store.get(f'error/{rank}').decode()}"
        except Exception:           # noqa: BLE001 - the message is a courtesy
            pass
        return ""

    def _await_workers(self) -> None:
        """Until every worker has started (imports, CUDA context) or one died (the watchdog fails it)."""
        keys = [f"hello/{r}" for r in range(1, self.world)]
        while not self.store.check(keys):
            self.check()
            time.sleep(0.05)

    # ---- shutdown ----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers (a STOP message, then a kill for any that has not exited within 10 s)."""
        if self._closing.is_set():
            return
        self._closing.set()
        if self.failure is None and hasattr(self, "channel"):
            try:
                self.channel.stop()
            except Exception:       # noqa: BLE001 - they are killed below
                pass
            deadline = time.monotonic() + 10
            for p in self.workers:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        for p in self.workers:
            if p.poll() is None:
                p.kill()
        for p in self.workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)


def _start(spec: WorkerSpec) -> subprocess.Popen:
    root = str(Path(__file__).resolve().parents[2])       # where `engine` is importable from
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    p = subprocess.Popen([sys.executable, "-m", "engine.workers.worker"], stdin=subprocess.PIPE, env=env)
    p.stdin.write(pickle.dumps(spec))
    p.stdin.close()
    return p


def _close_at_exit(ref) -> None:
    cluster = ref()
    if cluster is not None:
        cluster.close()


def _placement(config) -> tuple[str, list[str]]:
    """(device-group backend, each rank's device)."""
    device, world = config.torch_device(), config.tensor_parallel_size
    backend = config.tuning.tp_backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type != "cuda":
        return backend, ["cpu"] * world
    base = device.index if device.index is not None else torch.cuda.current_device()
    if backend == "gloo":                # several ranks on one GPU (tests): no graphs
        return backend, [f"cuda:{base}"] * world
    if base + world > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size {world} from cuda:{base} needs {base + world} GPUs, "
                         f"{torch.cuda.device_count()} visible")
    return backend, [f"cuda:{base + r}" for r in range(world)]
