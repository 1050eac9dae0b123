"""launch_step against fake_libcuda.c; run by tests/runner/test_native_launch.py as

    LD_LIBRARY_PATH=<dir holding the built fake libcuda.so.1> python -m hostfunc.testing.fake_step_launch_scenario

Covers: the calls in the Python launch's order on the right streams and events, the bytes of the upload and of
every download, a step without downloads (its copy-out stream untouched), refused null handles, and a driver
error named with the call that failed; event_times' reads in order, a null handle refused, a driver error named
with its pair.
"""
import ctypes

from hostfunc import _C

UPLOAD, DOWNLOAD, RECORD, WAIT, GRAPH, ELAPSED = 1, 2, 3, 4, 5, 6
COPY_IN, COMPUTE, COPY_OUT = 0x11, 0x12, 0x13
INPUTS_READY, START, SAMPLED_READY, COPY_DONE = 0x21, 0x22, 0x23, 0x24
GRAPH_EXEC = 0x31


def calls(fake) -> list[tuple]:
    out = (ctypes.c_uint64 * (4 * 64))()
    n = fake.fake_calls(out, 64)
    return [tuple(out[4 * i:4 * i + 4]) for i in range(min(n, 64))]


def main():
    fake = ctypes.CDLL("libcuda.so.1")
    assert _C.step_launch_error() == "", _C.step_launch_error()
    host_in, dev_in = ctypes.create_string_buffer(b"inputs!!", 8), ctypes.create_string_buffer(8)
    dev_tokens, host_tokens = ctypes.create_string_buffer(b"\x07" * 16, 16), ctypes.create_string_buffer(16)
    dev_lp, host_lp = ctypes.create_string_buffer(b"\x09" * 4, 4), ctypes.create_string_buffer(4)
    addr = ctypes.addressof
    streams, events = (COPY_IN, COMPUTE, COPY_OUT), (INPUTS_READY, START, SAMPLED_READY, COPY_DONE)
    downloads = [(addr(host_tokens), addr(dev_tokens), 12), (addr(host_lp), addr(dev_lp), 4)]
    _C.launch_step(streams, (addr(dev_in), addr(host_in), 8), events, GRAPH_EXEC, downloads)
    assert calls(fake) == [
        (UPLOAD, addr(dev_in), COPY_IN, 8), (RECORD, INPUTS_READY, COPY_IN, 0), (WAIT, COMPUTE, INPUTS_READY, 0),
        (RECORD, START, COMPUTE, 0), (GRAPH, GRAPH_EXEC, COMPUTE, 0), (RECORD, SAMPLED_READY, COMPUTE, 0),
        (WAIT, COPY_OUT, SAMPLED_READY, 0), (DOWNLOAD, addr(host_tokens), COPY_OUT, 12),
        (DOWNLOAD, addr(host_lp), COPY_OUT, 4), (RECORD, COPY_DONE, COPY_OUT, 0)]
    assert dev_in.raw == b"inputs!!" and host_tokens.raw == b"\x07" * 12 + b"\x00" * 4 and host_lp.raw == b"\x09" * 4

    _C.launch_step((COPY_IN, COMPUTE, 0), (addr(dev_in), addr(host_in), 8), (INPUTS_READY, START, SAMPLED_READY, 0),
                   GRAPH_EXEC, [])      # a tensor-parallel worker's step: its tokens stay on the device
    assert [c[0] for c in calls(fake)] == [UPLOAD, RECORD, WAIT, RECORD, GRAPH, RECORD]

    for bad in [dict(graph_exec=0), dict(streams=(COPY_IN, 0, COPY_OUT))]:
        args = dict(streams=streams, upload=(addr(dev_in), addr(host_in), 8), events=events, graph_exec=GRAPH_EXEC,
                    downloads=downloads) | bad
        try:
            _C.launch_step(**args)
            raise AssertionError(f"launch_step took {bad}")
        except ValueError as e:
            assert "null" in str(e), e
    assert calls(fake) == []
    try:
        _C.launch_step((COPY_IN, 0xbad, COPY_OUT), (addr(dev_in), addr(host_in), 8), events, GRAPH_EXEC, downloads)
        raise AssertionError("a driver error passed")
    except RuntimeError as e:
        assert "launch_step: graph: " in str(e), e
    calls(fake)
    _event_times(fake)
    print("fake step launch scenario ok")


def _event_times(fake):
    pairs = [(START, SAMPLED_READY), (0x100, 0x1100), (SAMPLED_READY, START)]
    times = _C.event_times(pairs)        # the fake's time: (second - first) / 1000 ms
    assert len(times) == 3 and all(abs(t - w) < 1e-6 for t, w in zip(times, [1e-3, 4.096, -1e-3])), times
    assert calls(fake) == [(ELAPSED, a, b, 0) for a, b in pairs]
    assert _C.event_times([]) == []
    for bad, kind, text in [([(START, 0)], ValueError, "null"), ([(START, SAMPLED_READY), (0xbad, START)],
                                                                   RuntimeError, "event_times: pair 1: ")]:
        try:
            _C.event_times(bad)
            raise AssertionError(f"event_times took {bad}")
        except kind as e:
            assert text in str(e), e
    calls(fake)


if __name__ == "__main__":
    main()
