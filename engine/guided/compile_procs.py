"""The engine's side of the grammar compile process (engine/guided/compile_worker.py): xgrammar compiles there, in
a child per compile that is killed once no request waits for it, and comes back in its serialised form.

A compile pool thread calls `run(job, guide)` and blocks until the child is done; `kill(job)` (any thread) ends a
running compile at once, and `run` then raises CompileAbandoned. The compile process starts with the service and
again on the next compile after it died (every compile it held fails, naming it).
"""
from __future__ import annotations

import itertools
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import xgrammar as xgr

class CompileAbandoned(RuntimeError):
    """Every request for this grammar gave up on it: its compile was stopped."""


class CompileCrashed(RuntimeError):
    """The compile's process ended without a result (killed by the system, or the compile process is gone)."""


class Job:
    """One compile: killed before it is sent, or while it runs."""

    def __init__(self, procs: "CompileProcesses"):
        self.procs, self.id = procs, None
        self.killed = False
        self.done = threading.Event()
        self.outcome: tuple = ()

    def kill(self) -> None:
        self.procs.kill(self)


class CompileProcesses:
    def __init__(self, info: xgr.TokenizerInfo, threads: int):
        self.info, self.threads = info, threads
        self._info_json = info.serialize_json()
        self._lock = threading.Lock()         # guards the socket's send side, `_jobs` and the process handle
        self._jobs: dict[int, Job] = {}
        self._ids = itertools.count()
        self._proc = self._conn = None
        self._closed = False
        self._ready = False                   # the process has its tokenizer info and takes compiles
        self.ready_since: float | None = None  # time.monotonic() it became ready (None: starting)
        self._waiting: list[tuple[Job, tuple]] = []     # jobs sent once it is ready
        self.folder = tempfile.mkdtemp(prefix="specdec-grammars-")
        with self._lock:
            self._start()

    def job(self) -> Job:
        return Job(self)

    def run(self, job: Job, guide) -> xgr.CompiledGrammar:
        """Compile `guide` in a child; raises CompileAbandoned (killed), or RuntimeError with xgrammar's message."""
        with self._lock:
            if job.killed:
                raise CompileAbandoned("the compile was stopped before it started")
            if self._closed:
                raise CompileCrashed("the grammar service is closed")
            if self._proc is None:
                self._start()
            job.id = next(self._ids)
            self._jobs[job.id] = job
            if self._ready:
                self._conn.send(("compile", job.id, tuple(guide)))
            else:                           # sent once the process says it is ready
                self._waiting.append((job, tuple(guide)))
        job.done.wait()
        kind, *rest = job.outcome
        if kind == "done":
            return self._load(rest[0])
        if kind == "killed":
            raise CompileAbandoned("the compile was stopped: no request waits for it any more")
        raise (RuntimeError if kind == "failed" else CompileCrashed)(rest[0])

    def kill(self, job: Job) -> None:
        """Stop `job` (any thread): a running child is killed, a job not sent yet is never sent."""
        with self._lock:
            job.killed = True
            if job.id not in self._jobs or job.done.is_set():
                return
            if not self._ready:
                self._jobs.pop(job.id)
                self._waiting = [(j, g) for j, g in self._waiting if j is not job]
                job.outcome = ("killed",)
                job.done.set()
                return
            try:
                self._conn.send(("kill", job.id))
            except OSError:                 # the process is gone: its reader fails the job
                pass

    def _load(self, path: str) -> xgr.CompiledGrammar:
        try:
            text = Path(path).read_text()
        finally:
            _unlink(path)
        return xgr.CompiledGrammar.deserialize_json(text, self.info)

    # ---- the process ----------------------------------------------------------------------------------------
    def _start(self) -> None:
        """Under the lock: a new compile process, told the tokenizer info; its reader thread answers jobs."""
        ours, theirs = socket.socketpair()
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        self._proc = subprocess.Popen([sys.executable, "-m", "engine.guided.compile_worker", str(theirs.fileno()),
                                       self.folder, str(self.threads)], pass_fds=[theirs.fileno()], env=env,
                                      stdin=subprocess.DEVNULL)
        theirs.close()
        self._conn, self._ready, self.ready_since = Connection(ours.detach()), False, None
        threading.Thread(target=self._read, args=(self._conn,), name="grammar-compile-reader", daemon=True).start()

    def _read(self, conn: Connection) -> None:
        try:
            conn.send(self._info_json)
            while True:
                msg = conn.recv()
                with self._lock:
                    if msg[0] == "ready":
                        self._ready, self.ready_since = True, time.monotonic()
                        for job, guide in self._waiting:
                            conn.send(("compile", job.id, guide))
                        self._waiting = []
                        continue
                    job = self._jobs.pop(msg[1], None)
                if job is not None:
                    job.outcome = (msg[0], *msg[2:])
                    job.done.set()
        except (EOFError, OSError):
            self._fail_all(conn, "the grammar compile process exited")

    def _fail_all(self, conn: Connection, message: str) -> None:
        """The reader's process is gone: its jobs fail, and the next compile starts another."""
        with self._lock:
            if conn is not self._conn:
                return
            jobs, self._jobs, self._waiting = list(self._jobs.values()), {}, []
            proc, self._proc = self._proc, None
        for job in jobs:
            job.outcome = ("died", message)
            job.done.set()
        conn.close()
        if proc is not None:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        """Stop the compile process (its children are killed); compiles still waiting fail."""
        with self._lock:
            proc, conn, self._proc, self._conn, self._closed = self._proc, self._conn, None, None, True
            jobs, self._jobs, self._waiting, ready = list(self._jobs.values()), {}, [], self._ready
        for job in jobs:
            job.outcome = ("died", "the grammar service closed")
            job.done.set()
        if proc is not None:
            try:
                if not ready:       # the reader may still be sending the tokenizer info: a second writer would
                    raise OSError   # interleave its bytes with it
                conn.send(("stop",))
                proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
