"""`specdec serve`'s first process: starts the engine process and --api-server-count API processes on one port
(these import and wait for the engine's model info, so both start-ups overlap), prints the "listening" line once
all serve, and stops them all on SIGINT/SIGTERM.

Failure handling: the engine process ending (a bug, a lost tensor-parallel worker, a kill) leaves the API
processes up, answering 503 that names it (they see it on the `alive` pipe); an API process ending stops the
server (the engine goes too). Every child dies with this process (PR_SET_PDEATHSIG), so nothing is left
holding the GPU even when this one is killed outright.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
from multiprocessing.connection import wait

from engine.options import engine_config
from engine.server.processes import api_process, engine_process, ipc

STOP_WAIT_S = 10.0


def run(args) -> int:
    config = engine_config(args)          # a bad option is refused here, before any process starts
    ctx = mp.get_context("spawn")
    addresses = ipc.Addresses.create()
    stopping = []
    previous = {s: signal.signal(s, lambda *_: stopping.append(1)) for s in (signal.SIGINT, signal.SIGTERM)}
    metrics_dir = _metrics_dir(args.api_server_count)
    engine = apis = None
    try:
        reservation = _reserve(args.host, args.port)
        host, port = reservation.getsockname()[:2]
        engine, engine_ready, alive = _spawn_engine(ctx, config, args, addresses)
        apis, infos, ready = _start_apis(ctx, args, addresses, port, alive)
        alive.close()                     # the API processes hold its read end
        info = _engine_info(engine, engine_ready)
        if info is None:
            return 2
        for conn in infos:
            try:
                conn.send(info)
            except OSError:               # that API process died starting: _wait_ready reports it
                pass
            conn.close()
        if not _wait_ready(apis, ready, engine, stopping):
            return 1
        reservation.close()
        name = args.served_model_name[0] if args.served_model_name else info.name
        print(f"specdec serve: listening on http://{host}:{port} (model {name}; engine pid {engine.pid}, "
              f"API pids {' '.join(str(p.pid) for p in apis)})", flush=True)
        return _watch(engine, apis, stopping)
    finally:
        _stop(apis or [], engine)
        for s, handler in previous.items():
            signal.signal(s, handler)
        addresses.remove()
        if metrics_dir:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def _spawn_engine(ctx, config, args, addresses):
    ready_r, ready_w = ctx.Pipe(duplex=False)
    alive_r, alive_w = ctx.Pipe(duplex=False)
    engine = ctx.Process(target=engine_process.main, name="specdec-engine",
                         args=(config, args.max_queued, addresses, args.api_server_count, ready_w, alive_w))
    engine.start()
    ready_w.close()
    alive_w.close()                   # from now on only the engine process holds the write end
    return engine, ready_r, alive_r


def _engine_info(engine, ready_r):
    """The engine process's ModelInfo once it serves; None (the error printed) if it failed to start."""
    try:
        kind, value = ready_r.recv()
    except EOFError:
        engine.join(5)
        kind, value = "error", f"the engine process exited during start-up (exit code {engine.exitcode})"
    if kind != "ready":
        print(f"specdec: error: {value}", file=sys.stderr)
        return None
    return value


def _start_apis(ctx, args, addresses, port, alive):
    """The API processes, each waiting on its pipe of `infos` for the engine's ModelInfo."""
    ready_r, ready_w = ctx.Pipe(duplex=False)
    apis, infos = [], []
    for client in range(args.api_server_count):
        info_r, info_w = ctx.Pipe(duplex=False)
        p = ctx.Process(target=api_process.main, name=f"specdec-api-{client}",
                        args=(vars(args), info_r, addresses, client, port, alive, ready_w))
        p.start()
        info_r.close()
        apis.append(p)
        infos.append(info_w)
    ready_w.close()
    return apis, infos, ready_r


def _wait_ready(apis, ready_r, engine, stopping) -> bool:
    waiting, count = [p.sentinel for p in apis], 0
    while count < len(apis):
        if stopping:
            return False
        for obj in wait([ready_r, engine.sentinel, *waiting], timeout=0.5):
            if obj is ready_r:
                try:
                    ready_r.recv()
                except EOFError:            # every API process is gone (one that failed to start says why)
                    print("specdec: error: the API processes exited during start-up", file=sys.stderr)
                    return False
                count += 1
            else:
                print("specdec: error: a server process exited during start-up", file=sys.stderr)
                return False
    return True


def _watch(engine, apis, stopping) -> int:
    code = 0
    sentinels = {engine.sentinel: engine, **{p.sentinel: p for p in apis}}
    while not stopping:
        for obj in wait(list(sentinels), timeout=0.5):
            proc = sentinels.pop(obj)
            if proc is engine:        # the API processes answer 503 from now on
                print(f"specdec serve: the engine process exited (exit code {engine.exitcode})", file=sys.stderr)
                code = 1
            else:
                print(f"specdec serve: API process {proc.name} exited (exit code {proc.exitcode}); stopping",
                      file=sys.stderr)
                return 1
    return code


def _stop(apis, engine) -> None:
    """API processes first (uvicorn finishes its responses), then the engine; whatever lingers is killed."""
    for group in (apis, [engine] if engine is not None else []):
        for p in group:
            if p.is_alive():
                p.terminate()
        for p in group:
            p.join(STOP_WAIT_S)
            if p.is_alive():
                p.kill()
                p.join()


def _reserve(host: str, port: int):
    """Hold the port (bound, not listening: no connection lands here) while the API processes bind it too."""
    return api_process.bind(host, port, reuse_port=True, listen=False)


def _metrics_dir(count: int) -> str | None:
    """Several API processes: prometheus-client's multiprocess mode (set before they import it)."""
    if count <= 1:
        return None
    folder = tempfile.mkdtemp(prefix="specdec-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder
    return folder
