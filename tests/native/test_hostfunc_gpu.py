"""GPU tests of hostfunc: captured callbacks replay, keep stream order, free cleanly, never deadlock.

Run: pytest -q -m gpu tests/native/test_hostfunc_gpu.py
"""
import gc
import sys
import threading

import pytest
import torch

import hostfunc
from hostfunc import HostfuncError

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def clean_state():
    torch.cuda.synchronize()
    hostfunc._C.take_errors()
    yield
    hostfunc.set_debug(False)
    torch.cuda.synchronize()
    hostfunc.free_all_hostfunc_user_data()
    hostfunc._C.take_errors()
    assert hostfunc.live_handles() == 0


def rss_bytes():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@hostfunc.hostfunc
def increase(x):
    x.add_(1)


@pytest.mark.timeout(60)
def test_blog_example_two_increments_ten_replays():
    x = torch.zeros(1, dtype=torch.int32)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with hostfunc.capture_scope() as scope, torch.cuda.graph(graph, stream=stream):
        increase(x)
        increase(x)
    assert len(scope.handles) == 2 and int(x) == 0  # capture records, it does not run
    for _ in range(10):
        graph.replay()
    hostfunc.synchronize()
    assert int(x) == 20
    assert scope.free() == 2 and hostfunc.live_handles() == 0


@pytest.mark.timeout(60)
def test_args_and_kwargs_survive_replay():
    log = []

    def record(a, b, *, key, scale=1):
        log.append((a, b, key, scale))

    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with hostfunc.capture_scope() as scope, torch.cuda.graph(graph, stream=stream):
        hostfunc.launch_hostfunc(stream, record, 1, "two", key=("k", 3), scale=2.5)
        hostfunc.launch_hostfunc(None, record, [4], {"tag": "x"}, key=None)  # only the graph holds these
        hostfunc.launch_hostfunc(stream.cuda_stream, record, 5, 6, key="raw handle")
    gc.collect()
    for _ in range(5):
        graph.replay()
    hostfunc.synchronize()
    expected = [(1, "two", ("k", 3), 2.5), ([4], {"tag": "x"}, None, 1), (5, 6, "raw handle", 1)]
    assert log == expected * 5
    assert all(hostfunc._C.handle_info(h)["captured"] for h in scope.handles)
    scope.free()


def _kernel_then_read(stream, dev, host, seen):
    torch.cuda._sleep(50_000)  # a slow kernel first: a misordered callback would read a stale value
    dev.add_(1)
    host.copy_(dev, non_blocking=True)
    hostfunc.launch_hostfunc(stream, lambda: seen.append(int(host[0])))


@pytest.mark.timeout(60)
def test_callback_sees_the_kernel_before_it():
    stream = torch.cuda.Stream()
    dev = torch.zeros(1, dtype=torch.int32, device="cuda")
    host = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    seen = []
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(20):
            _kernel_then_read(stream, dev, host, seen)
    hostfunc.synchronize(stream)
    assert seen == list(range(1, 21))

    graph = torch.cuda.CUDAGraph()
    with hostfunc.capture_scope() as scope, torch.cuda.graph(graph, stream=stream):
        _kernel_then_read(stream, dev, host, seen)
    del seen[:]
    for _ in range(10):
        graph.replay()
    hostfunc.synchronize()
    assert seen == list(range(21, 31))
    scope.free()


def _write_then_kernel(stream, host_in, dev_in, acc):
    hostfunc.launch_hostfunc(stream, lambda: host_in.add_(1))
    dev_in.copy_(host_in, non_blocking=True)  # H2D reads pinned memory after the callback wrote it
    acc.add_(dev_in)


@pytest.mark.timeout(60)
def test_kernel_sees_what_the_callback_wrote():
    stream = torch.cuda.Stream()
    host_in = torch.zeros(1, dtype=torch.int64, pin_memory=True)
    dev_in = torch.zeros(1, dtype=torch.int64, device="cuda")
    acc = torch.zeros(1, dtype=torch.int64, device="cuda")
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(20):
            _write_then_kernel(stream, host_in, dev_in, acc)
    hostfunc.synchronize(stream)
    assert int(host_in) == 20 and acc.item() == sum(range(1, 21))

    host_in.zero_()
    acc.zero_()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with hostfunc.capture_scope() as scope, torch.cuda.graph(graph, stream=stream):
        _write_then_kernel(stream, host_in, dev_in, acc)
    for _ in range(10):
        graph.replay()
    hostfunc.synchronize()
    assert int(host_in) == 10 and acc.item() == sum(range(1, 11))
    scope.free()


@pytest.mark.timeout(60)
def test_fork_join_across_two_streams_in_one_capture():
    main, side = torch.cuda.Stream(), torch.cuda.Stream()
    host = torch.zeros(1, dtype=torch.int64, pin_memory=True)
    dev = torch.zeros(1, dtype=torch.int64, device="cuda")
    acc = torch.zeros(1, dtype=torch.int64, device="cuda")
    fork, join = torch.cuda.Event(), torch.cuda.Event()
    fork.record(main)  # creates both CUDA events before the capture
    join.record(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with hostfunc.capture_scope() as scope, torch.cuda.graph(graph, stream=main):
        fork.record(main)
        side.wait_event(fork)
        hostfunc.launch_hostfunc(side, lambda: host.add_(1))
        join.record(side)
        main.wait_event(join)  # compute waits for the callback on the other stream
        dev.copy_(host, non_blocking=True)
        acc.add_(dev)
    assert len(scope.handles) == 1
    for _ in range(10):
        graph.replay()
    hostfunc.synchronize()
    assert int(host) == 10 and acc.item() == sum(range(1, 11))
    scope.free()


@pytest.mark.timeout(120)
def test_eager_launches_keep_memory_flat():
    stream = torch.cuda.Stream()
    payload, box = object(), [0]

    def bump(p, *, step):
        box[0] += step

    def launch(n):
        for i in range(n):
            hostfunc.launch_hostfunc(stream, bump, payload, step=1)
            if i % 2000 == 1999:
                stream.synchronize()
        hostfunc.synchronize(stream)

    launch(20_000)
    gc.collect()
    refs, rss = sys.getrefcount(payload), rss_bytes()
    launch(100_000)
    gc.collect()
    growth = rss_bytes() - rss
    assert box[0] == 120_000 and hostfunc.live_handles() == 0
    assert sys.getrefcount(payload) == refs
    assert growth < 8 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB over 100k eager launches"


@pytest.mark.timeout(120)
def test_graph_replayed_10000_times_then_freed():
    capture_stream, replay_stream = torch.cuda.Stream(), torch.cuda.Stream()
    box = [0]

    def bump(step):
        box[0] += step

    graph = torch.cuda.CUDAGraph()
    with hostfunc.capture_scope() as scope, torch.cuda.graph(graph, stream=capture_stream):
        hostfunc.launch_hostfunc(None, bump, 1)
        hostfunc.launch_hostfunc(None, bump, step=2)
    with torch.cuda.stream(replay_stream):
        for i in range(10_000):
            graph.replay()
            if i % 1000 == 999:
                replay_stream.synchronize()
    hostfunc.synchronize(replay_stream)
    assert box[0] == 30_000
    assert hostfunc.stats()["captured"] == 2
    assert scope.free() == 2 and hostfunc.live_handles() == 0
    del graph


@pytest.mark.timeout(60)
def test_callback_exception_reported_at_next_sync():
    stream = torch.cuda.Stream()
    after = []

    def boom(tag):
        raise ValueError(f"boom-{tag}")

    hostfunc.launch_hostfunc(stream, boom, "eager")
    hostfunc.launch_hostfunc(stream, after.append, 1)  # the stream goes on after a failed callback
    with pytest.raises(HostfuncError, match="boom-eager") as info:
        hostfunc.synchronize(stream)
    assert "ValueError" in str(info.value) and "Traceback" in str(info.value) and after == [1]
    hostfunc.check_errors()  # cleared

    graph = torch.cuda.CUDAGraph()
    with hostfunc.capture_scope() as scope, torch.cuda.graph(graph, stream=stream):
        hostfunc.launch_hostfunc(None, boom, "graph")
    for _ in range(3):
        graph.replay()
    event = torch.cuda.Event()
    event.record()
    with pytest.raises(HostfuncError, match="boom-graph") as info:
        hostfunc.synchronize(event)
    assert len(info.value.errors) == 3
    scope.free()


@pytest.mark.timeout(60)
def test_debug_mode_rejects_cuda_in_callback():
    stream = torch.cuda.Stream()
    dev = torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    hostfunc.set_debug(True)
    hostfunc.launch_hostfunc(stream, lambda: dev.add_(1))
    hostfunc.launch_hostfunc(stream, torch.cuda.current_stream)
    hostfunc.launch_hostfunc(stream, torch._C._cuda_getDeviceCount)
    with pytest.raises(HostfuncError, match="CUDA call inside a host callback") as info:
        hostfunc.synchronize(stream)
    assert len(info.value.errors) == 3
    assert all("CUDA call inside a host callback" in message for message in info.value.errors)
    assert dev.item() == 0


def _cuda_worker(stream, stop, ready, failures, iterations):
    try:
        event = torch.cuda.Event()
        with torch.cuda.stream(stream):
            while not stop.is_set():
                x = torch.randn(256, 256, device="cuda")
                y = torch.empty(4096, device="cuda").fill_(2.0)
                z = (x * 2 + 1).relu_().sum() + y.sum()
                event.record(stream)
                event.synchronize()  # releases the GIL
                del x, y, z
                iterations[0] += 1
                ready.set()
    except BaseException as exc:  # noqa: BLE001 (reported by the test)
        failures.append(exc)
        ready.set()


@pytest.mark.timeout(120)
def test_no_deadlock_with_another_thread_using_cuda():
    cb_stream, work_stream, replay_stream = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
    counts = [0, 0]

    def bump(slot):
        counts[slot] += 1

    graph = torch.cuda.CUDAGraph()  # captured before the worker starts: global-mode capture forbids its calls
    with hostfunc.capture_scope() as scope, torch.cuda.graph(graph, stream=cb_stream):
        hostfunc.launch_hostfunc(None, bump, 1)
    stop, ready, failures, iterations = threading.Event(), threading.Event(), [], [0]
    worker = threading.Thread(target=_cuda_worker, args=(work_stream, stop, ready, failures, iterations),
                              daemon=True)
    worker.start()
    assert ready.wait(timeout=30), "CUDA worker did not start"

    def launcher():
        with torch.cuda.stream(replay_stream):
            for i in range(20_000):
                hostfunc.launch_hostfunc(cb_stream, bump, 0)
                if i % 4 == 0:
                    graph.replay()
                if i % 1000 == 999:
                    cb_stream.synchronize()
        cb_stream.synchronize()
        replay_stream.synchronize()

    launching = threading.Thread(target=launcher, daemon=True)
    launching.start()
    launching.join(timeout=60)
    stop.set()
    worker.join(timeout=30)
    assert not launching.is_alive(), "launcher thread deadlocked"
    assert not worker.is_alive(), "CUDA worker thread deadlocked"
    assert not failures, failures
    hostfunc.synchronize()
    assert counts == [20_000, 5_000] and iterations[0] > 0
    scope.free()


class _Cycle:
    """Garbage only the cyclic collector frees; its finalizer says on which thread that happened."""
    finalized_on: list = []

    def __init__(self):
        self.me = self

    def __del__(self):
        _Cycle.finalized_on.append(threading.get_ident())


def test_no_garbage_collection_inside_callbacks():
    """A collection on the driver's callback thread could finalize objects owning CUDA resources (a graph, an
    event), whose CUDA calls are not permitted there: the process aborted (seen in the full GPU suite)."""
    stream, inside = torch.cuda.Stream(), []

    def make_garbage():
        inside.append((threading.get_ident(), gc.isenabled()))
        for _ in range(3 * gc.get_threshold()[0]):   # enough allocations to trigger a collection
            _Cycle()

    gc.collect()
    _Cycle.finalized_on.clear()
    for _ in range(10):
        hostfunc.launch_hostfunc(stream, make_garbage)
    hostfunc.synchronize(stream)
    callback_threads = {ident for ident, _ in inside}
    assert len(inside) == 10 and not any(enabled for _, enabled in inside)
    assert gc.isenabled()
    assert not callback_threads & set(_Cycle.finalized_on)
    gc.collect()
    assert len(_Cycle.finalized_on) >= 10 * 3 * gc.get_threshold()[0]


@pytest.mark.timeout(60)
def test_stale_replay_after_free_runs_nothing_even_with_newer_launches():
    """Handles are never-reused ids, so a replay of freed data finds nothing, even where a newer launch's data
    got the freed address: it records an error and runs no callback."""
    stream, calls = torch.cuda.Stream(), []
    old_graph, new_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with hostfunc.capture_scope() as old, torch.cuda.graph(old_graph, stream=stream):
        hostfunc.launch_hostfunc(None, calls.append, "old")
    old_graph.replay()
    hostfunc.synchronize()
    assert calls == ["old"] and old.free() == 1
    with hostfunc.capture_scope() as new, torch.cuda.graph(new_graph, stream=stream):
        for _ in range(100):
            hostfunc.launch_hostfunc(None, calls.append, "new")
    del calls[:]
    old_graph.replay()  # the bug being guarded against: freed data replayed
    with pytest.raises(HostfuncError, match="was freed but its graph was replayed"):
        hostfunc.synchronize()
    assert calls == []
    new_graph.replay()
    hostfunc.synchronize()
    assert calls == ["new"] * 100 and new.free() == 100


class _Holder:
    """Holds the only reference to a CUDA object and records on which thread it (so the object) died. Not a
    weakref: torch's Event does not clear its weakrefs when it dies, and the dangling weakref crashes later."""

    def __init__(self, obj, died_on):
        self.obj, self.died_on = obj, died_on

    def __del__(self):
        self.died_on.append(threading.get_ident())


@pytest.mark.timeout(60)
def test_cuda_objects_left_by_a_callback_are_released_on_a_python_thread():
    """The args of an eager callback hold the last references to a CUDA tensor and event: their destructors
    must not run on the driver's thread (CUDA calls are not permitted there) but at collect()."""
    stream = torch.cuda.Stream()
    event = torch.cuda.Event()
    event.record(stream)  # creates the CUDA event
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    died_on, ran_on, gate = [], [], threading.Event()
    holders = (_Holder(torch.ones(1 << 20, device="cuda"), died_on), _Holder(event, died_on))
    del event
    hostfunc.launch_hostfunc(stream, gate.wait)  # holds the stream: the next launch returns before it runs
    hostfunc.launch_hostfunc(stream, lambda *held: ran_on.append(threading.get_ident()), *holders)
    del holders
    gate.set()
    stream.synchronize()
    assert len(ran_on) == 1 and died_on == [] and torch.cuda.memory_allocated() > allocated
    assert hostfunc.collect() >= 1
    assert died_on == [threading.get_ident()] * 2 and torch.cuda.memory_allocated() == allocated
    hostfunc.synchronize()
