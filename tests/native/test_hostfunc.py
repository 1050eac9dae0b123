"""CPU tests of hostfunc: API validation, packing/lifetime, ids, owners, the graveyard, error recording and
the debug guard.

The trampoline runs synchronously through the ``_C._pack_for_test`` / ``_C._invoke_for_test`` hooks (the
latter without the GIL, like the driver's thread), so the refcount logic is covered without a GPU
(tests/native/test_hostfunc_gpu.py drives the real driver path).
"""
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import hostfunc
from hostfunc import HostfuncError, _C, _guard
from helpers import build_fake_libcuda, run_fake_driver_scenario


@pytest.fixture(autouse=True)
def clean_state():
    _C.take_errors()
    yield
    hostfunc.set_debug(False)
    hostfunc.free_all_hostfunc_user_data()
    _C.take_errors()
    assert hostfunc.live_handles() == 0


def pack(fn, *args, captured=False, owner=0, **kwargs):
    return _C._pack_for_test(fn, args, kwargs, captured, owner)


def fake_launch(stream, fn, args, kwargs, owner=0):
    """Stands in for _C.launch on CPU: a launch on a capturing stream."""
    return _C._pack_for_test(fn, args, kwargs, True, owner), True


def in_thread(fn, *args):
    """Run fn(*args) on a new thread, like the driver's callback thread; returns that thread's ident."""
    failures, ident = [], []

    def body():
        ident.append(threading.get_ident())
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 (re-raised below)
            failures.append(exc)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive() and not failures, failures
    return ident[0]


class Tracked:
    """Records on which thread it was destroyed."""
    died_on = []

    def __del__(self):
        Tracked.died_on.append(threading.get_ident())


def test_import_and_public_api():
    assert set(hostfunc.__all__) <= set(dir(hostfunc))
    assert issubclass(HostfuncError, RuntimeError)
    counts = hostfunc.stats()
    assert counts.pop("standing") >= 0      # other tests' engines may hold theirs
    assert counts == {"live": 0, "captured": 0, "pending_eager": 0, "errors": 0, "graveyard": 0}


@pytest.mark.parametrize("stream", ["0", 1.5, True, object(), [0]])
def test_bad_stream_type(stream):
    with pytest.raises(TypeError, match="stream must be"):
        hostfunc.launch_hostfunc(stream, print)


def test_negative_stream_handle():
    with pytest.raises(ValueError, match=">= 0"):
        hostfunc.launch_hostfunc(-1, print)


@pytest.mark.parametrize("fn", [None, 42, "print"])
def test_non_callable(fn):
    with pytest.raises(TypeError, match="callable"):
        hostfunc.launch_hostfunc(0, fn)
    with pytest.raises(TypeError, match="callable"):
        hostfunc.hostfunc(fn)


def test_bad_handles():
    with pytest.raises(TypeError):
        hostfunc.free_hostfunc_user_data("0x1")
    with pytest.raises(KeyError):
        hostfunc.free_hostfunc_user_data(0)
    with pytest.raises(KeyError, match="unknown or already freed"):
        hostfunc.free_hostfunc_user_data(0x1234560)
    with pytest.raises(KeyError):
        _C._invoke_for_test(0x1234560)


def test_double_free_and_eager_free():
    handle = pack(print, captured=True)
    hostfunc.free_hostfunc_user_data(handle)
    with pytest.raises(KeyError, match="already freed"):
        hostfunc.free_hostfunc_user_data(handle)
    eager = pack(print)
    with pytest.raises(ValueError, match="eager launch"):
        hostfunc.free_hostfunc_user_data(eager)
    hostfunc.free_all_hostfunc_user_data()
    assert hostfunc.stats()["pending_eager"] == 1  # free_all leaves pending eager launches alone
    _C._invoke_for_test(eager)


def test_synchronize_bad_target():
    with pytest.raises(TypeError, match="cannot synchronize"):
        hostfunc.synchronize(3)


def test_captured_args_and_kwargs_survive_every_replay():
    calls = []
    handle = pack(lambda *a, **k: calls.append((a, k)), [1], "two", captured=True, key={"k": 3})
    assert _C.handle_info(handle) == {"captured": True, "capture_id": 0, "owner": 0}
    for _ in range(3):
        _C._invoke_for_test(handle)
    assert calls == [(([1], "two"), {"key": {"k": 3}})] * 3
    assert hostfunc.stats()["captured"] == 1
    hostfunc.free_hostfunc_user_data(handle)
    assert hostfunc.live_handles() == 0


def test_eager_data_released_after_the_call():
    calls = []
    handle = pack(calls.append, "x")
    assert hostfunc.stats()["pending_eager"] == 1
    _C._invoke_for_test(handle)
    assert calls == ["x"] and hostfunc.live_handles() == 0
    with pytest.raises(KeyError):
        _C._invoke_for_test(handle)


def test_refcounts_flat_over_many_cycles():
    arg, kwarg, calls = object(), object(), [0]

    def callback(a, *, k):
        calls[0] += 1

    def cycles(n):
        for _ in range(n):
            _C._invoke_for_test(_C._pack_for_test(callback, (arg,), {"k": kwarg}, False))

    cycles(1000)
    hostfunc.collect()
    before = (sys.getrefcount(arg), sys.getrefcount(kwarg), sys.getrefcount(callback))
    start = time.perf_counter()
    cycles(1_000_000)
    assert time.perf_counter() - start < 20
    assert _C.graveyard_size() <= 2  # each pack released what the previous callback left
    hostfunc.collect()
    assert (sys.getrefcount(arg), sys.getrefcount(kwarg), sys.getrefcount(callback)) == before
    assert calls[0] == 1_001_000 and hostfunc.live_handles() == 0

    handles = [_C._pack_for_test(callback, (arg,), {"k": kwarg}, True) for _ in range(1000)]
    for handle in handles:
        _C._invoke_for_test(handle)
    assert hostfunc.free_all_hostfunc_user_data() == 1000
    assert (sys.getrefcount(arg), sys.getrefcount(kwarg), sys.getrefcount(callback)) == before


def test_concurrent_pack_invoke_free():
    """_invoke_for_test releases the GIL (the trampoline takes it, like on the driver's thread), so the four
    threads interleave in the registry, the trampoline and the graveyard."""
    failures, calls = [], []

    def worker(owner):
        try:
            for _ in range(20_000):
                handle = pack(len, (), captured=True, owner=owner)
                _C._invoke_for_test(handle)
                hostfunc.free_hostfunc_user_data(handle)
                _C._invoke_for_test(pack(len, ()))
                _C._invoke_for_test(handle, check=False)  # stale: records an error of owner 0
            _C._invoke_for_test(pack(calls.append, owner))
        except BaseException as exc:  # noqa: BLE001 (reported below)
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(owner,)) for owner in range(1, 5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a worker deadlocked"
    assert not failures, failures
    assert sorted(calls) == [1, 2, 3, 4] and hostfunc.live_handles() == 0
    errors = hostfunc.take_errors()
    assert len(errors) == _C.MAX_ERRORS + 1 and all(owner == 0 for owner, _ in errors)  # + the dropped note
    assert errors[-1][1].startswith(f"{80_000 - _C.MAX_ERRORS} more host callback error(s) dropped")


def test_freed_id_is_never_reused_and_a_stale_replay_runs_nothing():
    calls = []
    stale = pack(calls.append, "old", captured=True)
    hostfunc.free_hostfunc_user_data(stale)
    fresh = [pack(calls.append, "new", captured=True) for _ in range(2000)]  # malloc reuses freed blocks
    assert stale not in fresh and all(handle > stale for handle in fresh)
    _C._invoke_for_test(stale, check=False)
    assert calls == []
    assert hostfunc.stats()["errors"] == 1
    with pytest.raises(HostfuncError, match=f"handle {stale}\\) was freed but its graph was replayed") as info:
        hostfunc.check_errors()
    assert info.value.owners == [0]
    _C._invoke_for_test(fresh[0])
    assert calls == ["new"]
    with pytest.raises(KeyError, match="already freed"):
        _C._invoke_for_test(stale)


def test_errors_are_recorded_and_taken_per_owner(monkeypatch):
    monkeypatch.setattr(_C, "launch", fake_launch)

    def boom(tag):
        raise ValueError(f"boom-{tag}")

    with hostfunc.capture_scope(owner=7):
        a1 = hostfunc.launch_hostfunc(0, boom, "a1")
        with hostfunc.HostfuncScope(), hostfunc.HostfuncScope(owner=9):  # the innermost owner wins
            b1 = hostfunc.launch_hostfunc(0, boom, "b1")
        with hostfunc.HostfuncScope():  # no owner: inherits 7
            a2 = hostfunc.launch_hostfunc(0, boom, "a2")
    plain = hostfunc.launch_hostfunc(0, boom, "none")
    assert [_C.handle_info(h)["owner"] for h in (a1, b1, a2, plain)] == [7, 9, 7, 0]
    for handle in (a1, b1, a2, plain):
        _C._invoke_for_test(handle)
    with pytest.raises(HostfuncError, match="boom-a1") as info:
        hostfunc.check_errors(owner=7)
    assert info.value.owners == [7, 7] and "boom-a2" in info.value.errors[1]
    assert not any("boom-b1" in message for message in info.value.errors)
    hostfunc.check_errors(owner=7)  # a's are cleared, b's are left
    assert hostfunc.stats()["errors"] == 2
    taken = hostfunc.take_errors(owner=9)
    assert [owner for owner, _ in taken] == [9] and "boom-b1" in taken[0][1]
    assert hostfunc.take_errors(owner=9) == []
    with pytest.raises(HostfuncError, match="boom-none") as info:
        hostfunc.check_errors()
    assert info.value.owners == [0]
    assert hostfunc.take_errors() == []
    with pytest.raises(ValueError, match="owner"):
        hostfunc.HostfuncScope(owner=-1)
    with pytest.raises(TypeError, match="owner"):
        hostfunc.check_errors(owner=True)


def test_a_noisy_owner_cannot_hide_the_errors_of_another():
    noisy = pack(int, "x", captured=True, owner=1)
    for _ in range(_C.MAX_ERRORS + 10):
        _C._invoke_for_test(noisy)
    _C._invoke_for_test(pack(int, "y", owner=2))
    with pytest.raises(HostfuncError, match="'y'") as info:
        hostfunc.check_errors(owner=2)
    assert info.value.owners == [2] and info.value.dropped == 0
    with pytest.raises(HostfuncError) as info:
        hostfunc.check_errors(owner=1)
    assert len(info.value.errors) == _C.MAX_ERRORS - 1 and info.value.dropped == 11


def test_callback_thread_never_drops_a_last_reference():
    """What a callback leaves behind (its args, its result, its exception's frames) is released on an ordinary
    thread: on the driver's thread the destructor of a CUDA object would call CUDA."""
    def make_result():
        return Tracked()

    def raise_with_local():
        local = Tracked()  # noqa: F841 (kept alive by the traceback's frame)
        raise RuntimeError("with a local")

    Tracked.died_on.clear()
    args_handle = pack(lambda obj: None, Tracked())
    result_handle = pack(make_result)
    error_handle = pack(raise_with_local)
    callback_thread = in_thread(lambda: [_C._invoke_for_test(h) for h in (args_handle, result_handle, error_handle)])
    assert Tracked.died_on == [] and _C.graveyard_size() >= 3
    assert hostfunc.live_handles() == 0  # stats() released the graveyard, on this thread
    assert Tracked.died_on == [threading.get_ident()] * 3 and callback_thread not in Tracked.died_on
    assert hostfunc.stats()["graveyard"] == 0
    with pytest.raises(HostfuncError, match="with a local"):
        hostfunc.check_errors()


def test_collect_releases_the_graveyard_and_frees_refuse_inside_callbacks():
    Tracked.died_on.clear()
    in_thread(_C._invoke_for_test, pack(lambda obj: None, Tracked()))
    assert Tracked.died_on == []
    assert hostfunc.collect() >= 1 and Tracked.died_on == [threading.get_ident()]
    assert hostfunc.collect() == 0

    captured = pack(print, captured=True)
    inside = []
    _C._invoke_for_test(pack(lambda: inside.append(hostfunc.collect())))
    for call in (lambda: hostfunc.free_hostfunc_user_data(captured), hostfunc.free_all_hostfunc_user_data,
                 lambda: _C.free(captured), _C.free_all):
        _C._invoke_for_test(pack(call))
    assert inside == [0] and hostfunc.live_handles() == 1
    errors = [message for _, message in hostfunc.take_errors()]
    assert len(errors) == 4 and all("inside a host callback" in message for message in errors)
    hostfunc.free_hostfunc_user_data(captured)


def test_exception_recorded_with_traceback_then_cleared():
    def boom(tag):
        raise ValueError(f"boom-{tag}")

    after = []
    _C._invoke_for_test(pack(boom, "a"))
    _C._invoke_for_test(pack(after.append, 1))  # the next callback still runs
    _C._invoke_for_test(pack(boom, "b"))
    assert after == [1] and hostfunc.stats()["errors"] == 2
    with pytest.raises(HostfuncError, match="boom-a") as info:
        hostfunc.check_errors()
    message = str(info.value)
    assert "Traceback" in message and "ValueError" in message and "in boom" in message
    assert "1 more" in message and len(info.value.errors) == 2 and "boom-b" in info.value.errors[1]
    hostfunc.check_errors()  # cleared
    assert hostfunc.live_handles() == 0


def test_error_list_is_bounded():
    handle = pack(int, "not a number", captured=True)
    for _ in range(_C.MAX_ERRORS + 10):
        _C._invoke_for_test(handle)
    with pytest.raises(HostfuncError) as info:
        hostfunc.check_errors()
    assert len(info.value.errors) == _C.MAX_ERRORS and info.value.dropped == 10


def test_launch_inside_callback_is_rejected():
    _C._invoke_for_test(pack(hostfunc.launch_hostfunc, 0, print))
    with pytest.raises(HostfuncError, match="launch_hostfunc inside a host callback"):
        hostfunc.check_errors()
    assert not _C.in_callback()
    flags = []
    _C._invoke_for_test(pack(lambda: flags.append(_C.in_callback())))
    assert flags == [True]


def test_scope_collects_captured_handles(monkeypatch):
    monkeypatch.setattr(_C, "launch", fake_launch)
    calls = []
    with hostfunc.capture_scope() as outer:
        first = hostfunc.launch_hostfunc(0, calls.append, 1)
        with hostfunc.HostfuncScope() as inner:
            second = hostfunc.launch_hostfunc(0, calls.append, 2)
        third = hostfunc.launch_hostfunc(0, calls.append, 3)
    outside = hostfunc.launch_hostfunc(0, calls.append, 4)
    assert outer.handles == [first, third] and inner.handles == [second]
    for handle in (first, second, third, outside):
        _C._invoke_for_test(handle)
    assert calls == [1, 2, 3, 4]
    assert inner.free() == 1 and outer.free() == 2 and outer.free() == 0
    assert hostfunc.live_handles() == 1
    hostfunc.free_hostfunc_user_data(outside)


def test_owner_scope_tags_and_leaves_handles_to_the_collecting_scope(monkeypatch):
    """An owner_scope inside a graph's scope: its launches carry the owner, the graph's scope frees them."""
    monkeypatch.setattr(_C, "launch", fake_launch)
    owner, other = hostfunc.new_owner(), hostfunc.new_owner()
    assert owner != other and owner >= 2**32
    with hostfunc.capture_scope() as graph:
        with hostfunc.owner_scope(owner) as tags:
            handle = hostfunc.launch_hostfunc(0, int, "x")
    assert graph.handles == [handle] and tags.handles == []
    assert _C.handle_info(handle)["owner"] == owner
    assert graph.free() == 1 and hostfunc.live_handles() == 0
    with pytest.raises(TypeError, match="owner"):
        hostfunc.owner_scope(None)


def test_decorator_launches_on_current_stream(monkeypatch):
    seen = []
    monkeypatch.setattr(hostfunc, "_stream_handle", lambda stream: seen.append(stream) or 0)
    monkeypatch.setattr(_C, "launch", fake_launch)

    @hostfunc.hostfunc
    def increment(x, step=1):
        x += step

    handle = increment(torch.zeros(1), step=2)
    assert seen == [None] and increment.__name__ == "increment"
    hostfunc.free_hostfunc_user_data(handle)


def test_debug_guard_rejects_torch_cuda_calls():
    hostfunc.set_debug(True)
    assert hostfunc.is_debug()
    _C._invoke_for_test(pack(torch.cuda.synchronize))
    _C._invoke_for_test(pack(torch.cuda.current_stream))
    _C._invoke_for_test(pack(torch.cuda.Event))
    with pytest.raises(HostfuncError) as info:
        hostfunc.check_errors()
    assert len(info.value.errors) == 3
    assert all("CUDA call inside a host callback" in message for message in info.value.errors)


def test_debug_guard_reports_swallowed_violation():
    def sneaky():
        try:
            torch.cuda.synchronize()
        except Exception:
            pass

    hostfunc.set_debug(True)
    _C._invoke_for_test(pack(sneaky))
    with pytest.raises(HostfuncError, match="caught the error"):
        hostfunc.check_errors()


def test_debug_guard_rejects_tensor_ops_on_guarded_devices():
    _guard.warm_up()
    with pytest.raises(HostfuncError, match="CUDA call inside a host callback: aten.add"):
        _guard.run_guarded(lambda x: x + 1, (torch.empty(3, device="meta"),), None, devices=("meta",))
    with pytest.raises(HostfuncError, match="aten.ones"):
        _guard.run_guarded(torch.ones, (2,), {"device": "meta"}, devices=("meta",))


def test_debug_guard_lets_cpu_work_through():
    mask = torch.zeros(32, 1536, dtype=torch.int32)
    hostfunc.set_debug(True)
    handle = pack(lambda m: m.fill_(-1), mask, captured=True)
    _C._invoke_for_test(handle)
    hostfunc.check_errors()
    assert bool((mask == -1).all())
    assert _guard.run_guarded(torch.cuda.is_available, (), None) == torch.cuda.is_available()
    hostfunc.set_debug(False)
    _C._invoke_for_test(pack(torch.cuda.current_stream))
    errors = hostfunc.take_errors()
    assert all("CUDA call inside a host callback" not in message for _, message in errors)


def test_debug_from_environment():
    code = "import hostfunc; assert hostfunc.is_debug()"
    env = dict(os.environ, HOSTFUNC_DEBUG="1")
    env_run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert env_run.returncode == 0, env_run.stderr


def test_exit_with_live_data_is_clean():
    code = ("import hostfunc; from hostfunc import _C\n"
            "h = _C._pack_for_test(print, ('x',), None, True)\n"
            "e = _C._pack_for_test(print, ('eager',), None, False)\n"
            "_C.shutdown(); _C._invoke_for_test(h); _C._invoke_for_test(e)\n"
            "assert hostfunc.live_handles() == 2\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout == "", run.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_launch_without_gpu_raises_clearly():
    assert not hostfunc.is_available()
    with pytest.raises(RuntimeError, match="cannot launch a host callback: .*(libcuda|cuInit)"):
        hostfunc.launch_hostfunc(0, print)
    with pytest.raises(RuntimeError, match="hostfunc"):
        hostfunc.launch_hostfunc(None, print)
    with pytest.raises(RuntimeError, match="hostfunc"):
        hostfunc.hostfunc(print)("x")
    assert hostfunc.live_handles() == 0


def test_launch_path_with_fake_driver(tmp_path):
    if build_fake_libcuda(tmp_path) is None:
        pytest.skip("no C compiler or hostfunc/testing/ source to build the fake libcuda")
    run = run_fake_driver_scenario(tmp_path, "hostfunc.testing.fake_driver_scenario")
    assert run.returncode == 0 and "fake driver scenario ok" in run.stdout, run.stdout + run.stderr