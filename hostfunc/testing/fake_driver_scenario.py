"""The real launch path against fake_libcuda.c; run by tests/native/test_hostfunc.py as

    LD_LIBRARY_PATH=<dir holding the built fake libcuda.so.1> python hostfunc/testing/fake_driver_scenario.py

Covers: GIL released while the driver blocks (the fake queue holds 8 callbacks), eager data freed by the
trampoline, capture detection and capture ids, replays, error recording by owner, replay after free (even
once newer launches exist), nothing released on the driver's thread, driver errors, and two launching threads.
"""
import ctypes
import sys
import threading

import hostfunc
from hostfunc import HostfuncError, _C


def main():
    fake = ctypes.CDLL("libcuda.so.1")
    assert hostfunc.is_available(), _C.driver_error()
    calls, arg = [], object()
    before = sys.getrefcount(arg)
    for i in range(5000):  # the fake queue holds 8: launches block in the driver, which must not hold the GIL
        hostfunc.launch_hostfunc(7, lambda i, a: calls.append(i), i, arg)
    fake.fake_sync()
    assert calls == list(range(5000)) and hostfunc.live_handles() == 0 and sys.getrefcount(arg) == before

    fake.fake_begin_capture(ctypes.c_void_p(7))
    with hostfunc.capture_scope(owner=3) as scope:
        captured = hostfunc.launch_hostfunc(7, calls.append, "graph")
        hostfunc.launch_hostfunc(8, calls.append, "eager")  # another stream is not capturing
        hostfunc.launch_hostfunc(7, lambda: 1 / 0)
    fake.fake_end_capture()
    fake.fake_sync()
    assert len(scope.handles) == 2 and _C.handle_info(captured) == {"captured": True, "capture_id": 1, "owner": 3}
    del calls[:]
    fake.fake_replay(1000)
    fake.fake_sync()
    assert calls == ["graph"] * 1000
    hostfunc.check_errors(owner=4)  # nothing of another owner
    try:
        hostfunc.check_errors(owner=3)
        raise AssertionError("callback error not reported")
    except HostfuncError as exc:
        assert "ZeroDivisionError" in str(exc) and len(exc.errors) + exc.dropped == 1000 and set(exc.owners) == {3}
    assert scope.free() == 2 and hostfunc.live_handles() == 0

    newer = [_C._pack_for_test(calls.append, ("new",), None, True) for _ in range(100)]  # maybe at freed addresses
    del calls[:]
    fake.fake_replay(1)  # the graph's data is gone: the trampoline must notice, not crash nor run newer data
    fake.fake_sync()
    assert calls == [], calls
    try:
        hostfunc.check_errors()
        raise AssertionError("replay after free not reported")
    except HostfuncError as exc:
        assert "was freed but its graph was replayed" in str(exc) and len(exc.errors) == 2
    assert hostfunc.free_all_hostfunc_user_data() == len(newer)

    class Tracked:
        def __del__(self):
            died_on.append(threading.get_ident())

    died_on, ran_on, gate = [], [], threading.Event()
    hostfunc.launch_hostfunc(7, gate.wait)  # so that the next launch returns before its callback runs
    hostfunc.launch_hostfunc(7, lambda obj: ran_on.append(threading.get_ident()), Tracked())
    gate.set()
    fake.fake_sync()
    assert len(ran_on) == 1 and died_on == [] and _C.graveyard_size() >= 1  # at least the args tuple
    assert hostfunc.collect() >= 1 and died_on == [threading.get_ident()] != ran_on
    try:
        hostfunc.launch_hostfunc(0xBAD, print)
        raise AssertionError("driver error not raised")
    except RuntimeError as exc:
        assert "cuLaunchHostFunc failed: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (900)" in str(exc)
    assert hostfunc.live_handles() == 0

    counts = [0, 0]

    def bump(slot):
        counts[slot] += 1

    threads = [threading.Thread(target=lambda s=s: [hostfunc.launch_hostfunc(9, bump, s) for _ in range(3000)])
               for s in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    fake.fake_sync()
    assert counts == [3000, 3000] and hostfunc.live_handles() == 0
    print("fake driver scenario ok")


if __name__ == "__main__":
    main()
