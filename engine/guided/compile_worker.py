"""The grammar compile process: xgrammar compiles here, never in the engine process, so a compile can be stopped.

xgrammar has no cancellation point and its compile threads take whole cores, so a compile running in the engine
process outlives the request that gave up on it and slows every step meanwhile. This process (started by
engine/guided/compile_procs.py, `python -m engine.guided.compile_worker FD FOLDER THREADS`) imports xgrammar and
builds the tokenizer info once, then forks one child per compile. The child runs at the server's priority for its
first DEMOTE_CPU_S of CPU and under SCHED_IDLE after; it compiles, writes xgrammar's serialised form
(`serialize_json`) to FOLDER and exits. A compile its requests gave up on is killed (SIGKILL), which returns its CPU
and memory at once.

Protocol on the socket FD (multiprocessing Connection, pickled tuples):
- in: the tokenizer info's JSON (once), then ("compile", job, guide tuple), ("kill", job), ("stop",);
- out: ("ready",), then per job one of ("done", job, path), ("failed", job, xgrammar's message), ("died", job,
  how the child ended) or ("killed", job).
Invariant: this process never compiles and starts no thread, so a fork copies no lock held by another thread.
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import sys
from multiprocessing.connection import Connection, wait

import xgrammar as xgr

from engine.guided.guide import Guide, grammar_schema

# An ordinary grammar (a schema, a tool call's structural tag) compiles within this much CPU, at the server's own
# priority, so it ends on a busy machine too; past it a compile runs only where a core is idle (SCHED_IDLE). Not
# nice 19 before: that gets a sliver of a core the serving threads keep busy, and an ordinary compile outlived its
# request's budget (docs/server.md).
DEMOTE_CPU_S = 1.0
CHECK_S = 0.05          # how often the compile process looks at its children's CPU time


def _choice_grammar(source: str) -> str:
    alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(source))
    return f"root ::= {alternatives}"


def compile_guide(compiler: xgr.GrammarCompiler, guide: Guide) -> xgr.CompiledGrammar:
    kind, src, ws, _ = guide
    if kind == "json_schema":      # the rewritten schema (checked when the guide was made): same instances
        src = json.dumps(grammar_schema(json.loads(src)), ensure_ascii=False)
    if kind in ("json_schema", "json_object"):
        return compiler.compile_json_schema(src, any_whitespace=ws, strict_mode=True)
    if kind == "regex":
        return compiler.compile_regex(src)
    if kind == "ebnf":
        return compiler.compile_grammar(src)
    if kind == "choice":
        return compiler.compile_grammar(_choice_grammar(src))
    if kind == "structural_tag":
        return compiler.compile_structural_tag(src)
    raise ValueError(f"unknown guide kind {kind!r}")


def compile_cpus() -> set[int]:
    """The CPUs compiles may run on: the last quarter of this process's (at least one). Even at the lowest priority
    a compile's threads slow the serving threads of the cores they run on, so they keep to a few (docs/server.md)."""
    cpus = sorted(os.sched_getaffinity(0))
    return set(cpus[-max(1, len(cpus) // 4):])


def _child(info: xgr.TokenizerInfo, threads: int, guide: Guide, path: str) -> None:
    """In the forked child: compile, write the result (or the error's text to path + '.err'), exit."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)      # PR_SET_PDEATHSIG: never outlive the compile process
        cpus = compile_cpus()
        os.sched_setaffinity(0, cpus)                    # its threads, started later, inherit it
        compiler = xgr.GrammarCompiler(info, max_threads=min(threads, len(cpus)), cache_enabled=False)
        compiled = compile_guide(compiler, guide)
        with open(path + ".tmp", "w") as f:
            f.write(compiled.serialize_json())
        os.rename(path + ".tmp", path)
        code = 0
    except BaseException as exc:            # noqa: BLE001 - the request gets the message, the child exits
        with open(path + ".err", "w") as f:
            f.write(f"{exc}"[:4000])
        code = 1
    os._exit(code)


def _cpu_s(pid: int) -> float:
    """User and system CPU time of a process, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _idle(pid: int) -> None:
    """Every thread of `pid` under SCHED_IDLE (threads it makes later inherit it from theirs); twice, to catch a
    thread started meanwhile."""
    for _ in range(2):
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
            except OSError:             # the thread ended
                pass


class Zygote:
    def __init__(self, conn: Connection, folder: str, threads: int):
        self.conn, self.folder, self.threads = conn, folder, threads
        self.info = xgr.TokenizerInfo.deserialize_json(conn.recv())
        self.children: dict[int, tuple[int, int, str]] = {}    # read end of a child's pipe -> (job, pid, path)
        self.killed: set[int] = set()
        self.demoted: set[int] = set()      # children moved to SCHED_IDLE

    def run(self) -> None:
        self.conn.send(("ready",))
        while True:
            watch = any(pid not in self.demoted for _, pid, _ in self.children.values())
            for ready in wait([self.conn, *self.children], timeout=CHECK_S if watch else None):
                if ready is self.conn:
                    try:
                        msg = self.conn.recv()
                    except (EOFError, OSError):     # the engine is gone (OSError: mid-message)
                        return
                    if msg[0] == "stop":
                        return
                    self._handle(msg)
                else:
                    self._reap(ready)
            self._demote()

    def _demote(self) -> None:
        for _, pid, _ in self.children.values():
            if pid not in self.demoted:
                try:
                    if _cpu_s(pid) >= DEMOTE_CPU_S:
                        _idle(pid)
                        self.demoted.add(pid)
                except OSError:         # it ended: reaped on its pipe's EOF
                    pass

    def _handle(self, msg) -> None:
        if msg[0] == "compile":
            _, job, guide = msg
            path = os.path.join(self.folder, f"{job}.json")
            r, w = os.pipe()            # its write end closes when the child ends, however it ends
            pid = os.fork()
            if pid == 0:
                os.close(r)
                _child(self.info, self.threads, Guide(*guide), path)
            os.close(w)
            self.children[r] = (job, pid, path)
        elif msg[0] == "kill":
            for job, pid, _ in self.children.values():
                if job == msg[1]:
                    self.killed.add(job)
                    os.kill(pid, signal.SIGKILL)

    def _reap(self, r: int) -> None:
        job, pid, path = self.children.pop(r)
        os.close(r)
        _, status = os.waitpid(pid, 0)
        self.demoted.discard(pid)
        if job in self.killed:
            self.killed.discard(job)
            _remove(path, path + ".tmp", path + ".err")
            self.conn.send(("killed", job))
        elif os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
            self.conn.send(("done", job, path))
        else:
            self.conn.send(_failure(job, path, status))

    def close(self) -> None:
        for _, pid, _ in self.children.values():
            os.kill(pid, signal.SIGKILL)
        for _, pid, _ in self.children.values():
            os.waitpid(pid, 0)
        shutil.rmtree(self.folder, ignore_errors=True)


def _failure(job: int, path: str, status: int) -> tuple:
    try:
        with open(path + ".err") as f:
            return ("failed", job, f.read())
    except OSError:
        how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit code {os.WEXITSTATUS(status)}"
        return ("died", job, f"its compile process ended ({how})")
    finally:
        _remove(path, path + ".tmp", path + ".err")


def _remove(*paths: str) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def main(argv: list[str]) -> None:
    fd, folder, threads = int(argv[0]), argv[1], int(argv[2])
    signal.signal(signal.SIGINT, signal.SIG_IGN)        # the engine decides when this process stops
    try:
        zygote = Zygote(Connection(fd), folder, threads)
    except (EOFError, OSError):         # the engine went away while this process started (OSError: mid-message)
        shutil.rmtree(folder, ignore_errors=True)
        return
    try:
        zygote.run()
    finally:
        zygote.close()


if __name__ == "__main__":
    main(sys.argv[1:])
