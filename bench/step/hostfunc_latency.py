"""Per-replay cost of captured hostfunc callbacks, against plain ctypes / cuda-python callbacks.

    python -m bench.step.hostfunc_latency [--replays 2000] [--warmup 200] [--out bench/results/hostfunc_latency.json]

Every graph holds one tiny kernel plus the callbacks under test; "baseline_kernel_only" is that kernel alone,
and us_over_baseline is the difference. Modes: "graph_throughput" replays back to back and syncs once
(us = total / replays), "graph_latency" syncs after every replay, "eager" launches without a graph.
The ctypes and cuda-python comparisons run in a child process: hostfunc keeps a Python thread state on the
driver's callback thread, which would also speed up (and so flatter) any later ctypes callback there.
"""
import argparse
import ctypes
import json
import os
import subprocess
import sys
import time

import torch

from bench.common import REPO, git_commit

HOSTFN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replays", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "hostfunc_latency.json"))
    parser.add_argument("--child", choices=["ctypes", "cuda-python-graph"], help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def capture(body, stream, keep_alive):
    """A graph of one tiny kernel followed by body() (which enqueues the callbacks)."""
    x = torch.zeros(1, device="cuda")
    keep_alive.append(x)  # the graph's kernel writes x on every replay
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        x.add_(1)
        body()
    return graph


def time_graph(graph, stream, args, sync_each=False):
    replays = args.replays // 4 if sync_each else args.replays
    with torch.cuda.stream(stream):
        for _ in range(args.warmup):
            graph.replay()
        stream.synchronize()
        start = time.perf_counter()
        for _ in range(replays):
            graph.replay()
            if sync_each:
                stream.synchronize()
        stream.synchronize()
    return (time.perf_counter() - start) / replays * 1e6, replays


def time_eager(launch, stream, args):
    for _ in range(args.warmup):
        launch()
    stream.synchronize()
    start = time.perf_counter()
    for _ in range(args.replays):
        launch()
    stream.synchronize()
    return (time.perf_counter() - start) / args.replays * 1e6, args.replays


def rec(bench, mode, timing, callbacks=1, note="", process="main"):
    us_per_replay, replays = timing
    return {"bench": bench, "mode": mode, "us_per_call": us_per_replay / max(callbacks, 1),
            "us_per_replay": us_per_replay, "callbacks_per_replay": callbacks, "replays": replays,
            "process": process, "note": note}


def graph_records(name, body, stream, args, callbacks=1, note="", process="main"):
    graph = capture(body, stream, keep_alive := [])
    records = [rec(name, "graph_throughput", time_graph(graph, stream, args), callbacks, note, process),
               rec(name, "graph_latency", time_graph(graph, stream, args, True), callbacks, note, process)]
    del graph, keep_alive
    return records


def hostfunc_records(args):
    import hostfunc

    stream = torch.cuda.Stream()
    mask = torch.empty(32, 1536, dtype=torch.int32, pin_memory=True)
    mask_np = mask.numpy()

    def empty():
        pass

    records = graph_records("baseline_kernel_only", lambda: None, stream, args, callbacks=0)
    with hostfunc.capture_scope() as scope:
        records += graph_records("hostfunc_empty", lambda: hostfunc.launch_hostfunc(stream, empty), stream, args)
        records += graph_records("hostfunc_fill_bitmask_torch",
                                 lambda: hostfunc.launch_hostfunc(stream, mask.fill_, -1), stream, args)
        records += graph_records("hostfunc_fill_bitmask_numpy",
                                 lambda: hostfunc.launch_hostfunc(stream, mask_np.fill, -1), stream, args)
        records += graph_records("hostfunc_empty_x10",
                                 lambda: [hostfunc.launch_hostfunc(stream, empty) for _ in range(10)],
                                 stream, args, callbacks=10)
    records.append(rec("hostfunc_empty", "eager", time_eager(lambda: hostfunc.launch_hostfunc(stream, empty),
                                                                stream, args)))
    hostfunc.synchronize()
    assert int(mask[0, 0]) == -1 and bool((torch.from_numpy(mask_np) == -1).all())
    scope.free()
    return records


def libcuda_launcher():
    lib = ctypes.CDLL("libcuda.so.1")  # CDLL releases the GIL around the call
    launch = lib.cuLaunchHostFunc
    launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    launch.restype = ctypes.c_int
    return launch


def ctypes_records(args):
    """Child process: a plain ctypes CFUNCTYPE through libcuda.so.1, then through cuda-python (eager)."""
    stream = torch.cuda.Stream()
    callback = HOSTFN(lambda data: None)  # kept alive for every replay: the pointer needs no user data
    pointer = ctypes.cast(callback, ctypes.c_void_p)
    launch = libcuda_launcher()

    def launch_one():
        rc = launch(stream.cuda_stream, pointer, None)
        assert rc == 0, f"cuLaunchHostFunc failed: {rc}"

    records = graph_records("baseline_kernel_only", lambda: None, stream, args, 0, "child process", "child")
    records += graph_records("ctypes_libcuda_empty", launch_one, stream, args, process="child")
    records += graph_records("ctypes_libcuda_empty_x10", lambda: [launch_one() for _ in range(10)], stream, args,
                             10, process="child")
    records.append(rec("ctypes_libcuda_empty", "eager", time_eager(launch_one, stream, args), process="child"))
    try:
        launch_cp = cuda_python_launcher(stream, callback)
    except Exception as exc:  # noqa: BLE001 (optional dependency: report why it is missing)
        return records + [missing("cuda_python_ctypes_empty", "eager", f"cuda-python unusable: {exc!r}")]
    records.append(rec("cuda_python_ctypes_empty", "eager", time_eager(launch_cp, stream, args), process="child",
                       note="cuda.bindings cuLaunchHostFunc with a ctypes CFUNCTYPE"))
    return records


def cuda_python_launcher(stream, callback):
    try:
        from cuda.bindings import driver
    except ImportError:
        from cuda import cuda as driver  # cuda-python < 12.6
    address = ctypes.cast(callback, ctypes.c_void_p).value
    try:
        fn = driver.CUhostFn(address)
    except TypeError:
        fn = driver.CUhostFn(_ptr=ctypes.addressof(callback))
    handle = driver.CUstream(stream.cuda_stream)

    def launch_one():
        (err,) = driver.cuLaunchHostFunc(handle, fn, 0)
        assert err == driver.CUresult.CUDA_SUCCESS, err

    launch_one()
    stream.synchronize()
    return launch_one


def cuda_python_graph_records(args):
    """Grandchild: can a cuda-python callback be captured and replayed? Counted, so a silent failure shows."""
    stream, count = torch.cuda.Stream(), [0]
    callback = HOSTFN(lambda data: count.__setitem__(0, count[0] + 1))
    launch_one = cuda_python_launcher(stream, callback)
    count[0] = 0
    graph = capture(launch_one, stream, keep_alive := [])  # noqa: F841 (holds the launch's objects while it replays)
    timing = time_graph(graph, stream, args)
    expected = args.warmup + args.replays
    note = (f"replay count ok ({count[0]})" if count[0] == expected else
            f"replays ran {count[0]} callbacks, expected {expected}: cannot replay correctly")
    return [rec("cuda_python_ctypes_empty", "graph_throughput", timing, note=note, process="child")]


def missing(bench, mode, note):
    return {"bench": bench, "mode": mode, "us_per_call": None, "us_per_replay": None, "callbacks_per_replay": 1,
            "replays": 0, "process": "child", "note": note}


def run_child(name, args, timeout=300):
    command = [sys.executable, "-m", "bench.step.hostfunc_latency", "--child", name, "--replays", str(args.replays),
               "--warmup", str(args.warmup)]
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return None, f"child {name} timed out after {timeout}s"
    for line in out.stdout.splitlines():
        if line.startswith("RECORDS "):
            return json.loads(line[len("RECORDS "):]), ""
    return None, f"child {name} exited with rc={out.returncode}: {out.stderr.strip()[-400:]}"


def add_overheads(records):
    base = {(r["process"], r["mode"]): r["us_per_replay"] for r in records if r["bench"] == "baseline_kernel_only"}
    for r in records:
        b = base.get((r["process"], r["mode"]))
        over = r["us_per_replay"] - b if b is not None and r["us_per_replay"] is not None else None
        per = r["callbacks_per_replay"]
        r["us_over_baseline"] = over / per if over is not None and per else None


def print_table(records):
    def fmt(value):
        return "-" if value is None else f"{value:.2f}"

    print("| bench | mode | process | us/call | us over baseline (per callback) | replays | note |")
    print("|---|---|---|---|---|---|---|")
    for r in records:
        print(f"| {r['bench']} | {r['mode']} | {r['process']} | {fmt(r['us_per_call'])} | "
              f"{fmt(r['us_over_baseline'])} | {r['replays']} | {r['note']} |")


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        records = ctypes_records(args) if args.child == "ctypes" else cuda_python_graph_records(args)
        print("RECORDS " + json.dumps(records), flush=True)
        return
    if not torch.cuda.is_available():
        sys.exit("hostfunc_latency: needs a CUDA GPU")
    child, why = run_child("ctypes", args)  # first, while nothing else ran callbacks on this GPU
    records = child or [missing("ctypes_libcuda_empty", "graph_throughput", why)]
    graph_child, why = run_child("cuda-python-graph", args)
    records += graph_child or [missing("cuda_python_ctypes_empty", "graph_throughput",
                                       f"cannot capture and replay ({why})")]
    records = hostfunc_records(args) + records
    add_overheads(records)
    meta = {"device": torch.cuda.get_device_name(), "git_commit": git_commit(), "command": sys.argv}
    records = [{**r, **meta} for r in records]
    print_table(records)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as out:
        json.dump(records, out, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
