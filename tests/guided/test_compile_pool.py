"""engine/guided/compile_pool.py and the grammar service's sharing: fairness between owners, bounds, and
cancelling a queued compile; the service with the real compiler and tokenizer."""
import threading
import time

import pytest

from engine.guided.compile_pool import CompileBusy, CompilePool
from engine.guided.guide import Guide


def blocker():
    """A job that runs until released, and an event set once it runs."""
    started, release = threading.Event(), threading.Event()

    def job():
        started.set()
        release.wait(10)
        return "done"
    return job, started, release


def test_one_owner_cannot_take_every_thread():
    pool = CompilePool(threads=2, queue=64)
    jobs = [blocker() for _ in range(3)]
    futures = [pool.submit(job, "greedy", bounded=True) for job, _, _ in jobs]
    assert jobs[0][1].wait(5)
    time.sleep(0.1)
    assert not jobs[1][1].is_set()               # its share is threads - 1 = 1 running
    other = pool.submit(lambda: "fair", "other", bounded=True)
    assert other.result(5) == "fair"             # the free thread serves another owner at once
    for _, _, release in jobs:
        release.set()
    assert [f.result(5) for f in futures] == ["done"] * 3
    assert pool.unfinished() == 0
    pool.close()


def test_bounds_refuse_an_owner_past_its_share_once_crowded_and_all_past_the_queue():
    pool = CompilePool(threads=1, queue=8)       # a quarter of the queue per owner once 6 are unfinished: 2
    job, started, release = blocker()
    pool.submit(job, "a", bounded=True)
    for _ in range(5):                           # alone, a client takes up to three quarters
        pool.submit(lambda: 1, "a", bounded=True)
    with pytest.raises(CompileBusy, match="this client has 6 grammars compiling and the queue is nearly full; at "
                                          "most 2"):
        pool.submit(lambda: 1, "a", bounded=True)
    pool.submit(lambda: 1, "b", bounded=True)    # another client still has room
    pool.submit(lambda: 1, "b", bounded=True)
    with pytest.raises(CompileBusy, match="8 grammars are compiling"):
        pool.submit(lambda: 1, "c", bounded=True)
    pool.submit(lambda: 1, None, bounded=False)  # the engine's own: never refused
    release.set()
    deadline = time.monotonic() + 5
    while pool.unfinished() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.unfinished() == 0
    pool.close()


def test_a_cancelled_queued_compile_never_runs():
    pool = CompilePool(threads=1, queue=8)
    job, started, release = blocker()
    pool.submit(job, "a", bounded=True)
    ran = []
    queued = pool.submit(lambda: ran.append(1), "b", bounded=True)
    assert started.wait(5) and queued.cancel()
    release.set()
    time.sleep(0.2)
    assert not ran and pool.unfinished() == 0
    pool.close()


@pytest.fixture(scope="module")
def service(engine):
    from engine.guided.compiler import GrammarService
    s = GrammarService(engine.tokenizer, engine.runner.vocab, engine.eos_ids, threads=2, queue=8)
    yield s
    s.close()


def test_requests_for_one_guide_share_its_compile_and_then_its_cache(service):
    guide = Guide("regex", "shared-[a-z]{3}", False)
    first, second = service.submit(guide, "a"), service.submit(guide, "b")
    assert first.future is second.future
    first.cancel()                                # one request gives up: the other still gets its grammar
    assert second.future.result(30) is not None
    third = service.submit(guide, "c")
    assert third.future.done() and third.future.result() is second.future.result()
    assert service.compiling() == 0


def test_a_valid_schema_the_backend_cannot_compile_says_so(service):
    """xgrammar 0.2.8 with its own cache on fails an internal check on any fixed repetition in a pattern (the
    service keeps that cache off, and compiles it): that real failure gets a message naming the backend."""
    import xgrammar as xgr

    from engine.guided.compiler import compile_error
    guide = Guide("json_schema", '{"type": "string", "pattern": "[a-z]{255}"}', False)
    assert service.submit(guide).future.result(30) is not None
    cached = xgr.GrammarCompiler(service.info, max_threads=1, cache_enabled=True)
    with pytest.raises(Exception) as info:
        cached.compile_json_schema(guide.source, strict_mode=True)
    message = compile_error(guide, info.value)
    assert message.startswith("json_schema is valid but the grammar backend (xgrammar) could not compile it")
    assert "Check failed" not in message
    bad = Guide("json_schema", '{"type": "strin"}', False)
    assert compile_error(bad, RuntimeError("Check failed: x")).startswith("invalid json_schema: ")


# ---- compiles in processes (engine/guided/compile_procs.py) -----------------------------------------------------
def heavy_schema(tag: str) -> str:
    """Within every size bound, yet xgrammar compiles it for minutes: 40 branches of 30 patterned strings."""
    import json
    branch = lambda b: {"type": "object", "required": [f"{tag}{b}_0"], "properties": {   # noqa: E731
        f"{tag}{b}_{i}": {"type": "string", "pattern": "[a-z]{1,50}(x|y)+[0-9]{1,40}"} for i in range(30)}}
    return json.dumps({"anyOf": [branch(b) for b in range(40)]})


@pytest.fixture(scope="module")
def isolated(engine):
    from engine.guided.compiler import GrammarService
    s = GrammarService(engine.tokenizer, engine.runner.vocab, engine.eos_ids, threads=2, queue=8, processes=True)
    yield s
    s.close()


def test_a_grammar_compiled_in_a_process_masks_as_one_compiled_here(isolated):
    import torch
    import xgrammar as xgr
    guide = Guide("json_schema", '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}',
                  False)
    there, here = isolated.submit(guide, "a").future.result(120), isolated.compile_now(guide)
    masks = xgr.allocate_token_bitmask(2, isolated.vocab_size)
    for i, compiled in enumerate((there, here)):
        matcher = xgr.GrammarMatcher(compiled)
        for token in isolated._hf.encode('{"n": 1', add_special_tokens=False):
            assert matcher.accept_token(token)
        matcher.fill_next_token_bitmask(masks, i)
    assert torch.equal(masks[0], masks[1])
    bad = isolated.submit(Guide("regex", "[", False), "a")
    assert bad.future.exception(120) is not None and "Unclosed" in bad.poll()


def test_an_abandoned_compile_is_killed_at_once_and_the_next_one_runs(isolated):
    import psutil
    heavy = [isolated.submit(Guide("json_schema", heavy_schema(f"h{i}"), False), owner) for i, owner in enumerate("ab")]
    zygote = psutil.Process(isolated.procs._proc.pid)
    deadline = time.monotonic() + 60
    while len(zygote.children()) < 2 and time.monotonic() < deadline:     # both compiling in children
        time.sleep(0.05)
    assert len(zygote.children()) == 2 and isolated.compiling() == 2
    t0 = time.monotonic()
    for request in heavy:
        request.cancel()
    while isolated.compiling() and time.monotonic() - t0 < 5:
        time.sleep(0.01)
    assert isolated.compiling() == 0 and not zygote.children(), "killed, not left to run"
    assert time.monotonic() - t0 < 1.0
    assert all("stopped" in r.poll() for r in heavy)
    again = isolated.submit(Guide("regex", "after-[0-9]{2}", False), "greedy")
    assert again.future.result(60) is not None


def test_a_lost_compile_process_fails_its_compiles_and_the_next_starts_another(isolated):
    import os
    import signal
    running = isolated.submit(Guide("json_schema", heavy_schema("lost"), False), "a")
    deadline = time.monotonic() + 60
    while not running.future.running() and time.monotonic() < deadline:
        time.sleep(0.05)
    old = isolated.procs._proc.pid
    time.sleep(0.5)                                     # the compile is under way in a child
    os.kill(old, signal.SIGKILL)
    assert running.future.exception(30) is not None and "exited" in running.poll()
    again = isolated.submit(Guide("regex", "again-[0-9]{3}", False), "a")
    assert again.future.result(120) is not None and isolated.procs._proc.pid != old


def test_a_compile_runs_at_the_servers_priority_until_its_cpu_budget_then_in_idle_time(isolated):
    """A compile's first DEMOTE_CPU_S of CPU run at the compile process's own priority (an ordinary grammar then
    ends on a busy machine: at nice 19 a 0.5 s one took a minute beside busy loops, docs/server.md), the rest under
    SCHED_IDLE. Read from a long compile's threads, before and after its budget."""
    import os

    import psutil

    from engine.guided.compile_worker import DEMOTE_CPU_S
    zygote = psutil.Process(isolated.procs._proc.pid)
    heavy = isolated.submit(Guide("json_schema", heavy_schema("priority"), False), "a")
    try:
        seen, deadline, child = [], time.monotonic() + 60, None
        while time.monotonic() < deadline and (not seen or seen[-1][0] <= DEMOTE_CPU_S + 0.3):
            child = child or next(iter(zygote.children()), None)
            if child is not None:
                try:
                    cpu = sum(child.cpu_times()[:2])
                    seen.append((cpu, {(os.sched_getscheduler(t.id), os.getpriority(os.PRIO_PROCESS, t.id))
                                       for t in child.threads()}))
                except (OSError, psutil.NoSuchProcess):      # a thread ended while it was read: read again
                    pass
            time.sleep(0.02)
    finally:
        heavy.cancel()
    own = (os.SCHED_OTHER, zygote.nice())
    early = [policies for cpu, policies in seen if cpu < DEMOTE_CPU_S - 0.2]
    assert early and all(policies == {own} for policies in early), seen[:5]
    assert seen[-1][0] > DEMOTE_CPU_S + 0.3 and {p for p, _ in seen[-1][1]} == {os.SCHED_IDLE}, seen[-1]


def test_closing_while_the_compile_process_starts_ends_it_cleanly(engine, capfd):
    """Closed at once, while its reader thread is still sending the tokenizer info: the compile process is
    stopped without reading a message that a second writer broke into (it printed a decoding traceback)."""
    from engine.guided.compiler import GrammarService
    for _ in range(2):
        s = GrammarService(engine.tokenizer, engine.runner.vocab, engine.eos_ids, threads=1, queue=4, processes=True)
        proc = s.procs._proc
        s.close()
        assert proc.poll() is not None
    err = capfd.readouterr().err
    assert "Traceback" not in err, err[-2000:]


def test_a_compile_process_whose_engine_dies_mid_message_exits_quietly(tmp_path):
    """The engine went away while it sent the tokenizer info: the compile process ends without a traceback."""
    import socket
    import struct
    import subprocess
    import sys
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen([sys.executable, "-m", "engine.guided.compile_worker", str(theirs.fileno()),
                             str(tmp_path / "grammars"), "1"], pass_fds=[theirs.fileno()], stderr=subprocess.PIPE,
                            text=True)
    theirs.close()
    ours.sendall(struct.pack("!i", 1 << 20) + b"x" * 1000)      # a message header, then a fraction of its bytes
    ours.close()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in err, err[-2000:]
