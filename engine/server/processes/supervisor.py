"""`specdec serve`'s first process: starts the engine process (--data-parallel-size of them, one a GPU) and
--api-server-count API processes on one port (these import and wait for the engines' model info, so both start-ups
overlap), prints the "listening" line once all serve, and stops them all on SIGINT/SIGTERM.

Failure handling: an engine process ending (a bug, a lost tensor-parallel worker, a kill) fails the requests it
held; the API processes see it on its `alive` pipe and send later requests to the other engines, or answer 503 that
names it when none is left. An API process ending stops the server (the engines go too). Every child dies with this
process (PR_SET_PDEATHSIG), so nothing is left holding the GPU even when this one is killed outright.
"""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
from contextlib import contextmanager
from multiprocessing.connection import wait

from engine.options import engine_config
from engine.server.processes import api_process, engine_process, ipc

STOP_WAIT_S = 10.0


def run(args) -> int:
    setups = engine_setups(engine_config(args), args)   # a bad option is refused here, before any process starts
    ctx = mp.get_context("spawn")
    addresses = ipc.Addresses.create()
    stopping = []
    previous = {s: signal.signal(s, lambda *_: stopping.append(1)) for s in (signal.SIGINT, signal.SIGTERM)}
    metrics_dir = _metrics_dir(args.api_server_count)
    engines, apis = [], None
    try:
        reservation = _reserve(args.host, args.port)
        host, port = reservation.getsockname()[:2]
        if len(setups) > 1 and setups[0][0].prefix_caching:      # each engine's cached pages, for the placement
            setups = [(dataclasses.replace(config, kv_events_endpoint=addresses.kv_events(i)), env)
                      for i, (config, env) in enumerate(setups)]
        started = [_spawn_engine(ctx, config, env, args, addresses, i) for i, (config, env) in enumerate(setups)]
        engines = [proc for proc, _, _ in started]
        alives = [alive for _, _, alive in started]
        apis, infos, ready = _start_apis(ctx, args, addresses, port, alives)
        for alive in alives:
            alive.close()                 # the API processes hold their read ends
        found = [_engine_info(proc, engine_ready) for proc, engine_ready, _ in started]
        if any(info is None for info in found):
            return 2
        for conn in infos:
            try:
                conn.send(found[0])
            except OSError:               # that API process died starting: _wait_ready reports it
                pass
            conn.close()
        if not _wait_ready(apis, ready, engines, stopping):
            return 1
        reservation.close()
        name = args.served_model_name[0] if args.served_model_name else found[0].name
        pids = " ".join(str(p.pid) for p in engines)
        print(f"specdec serve: listening on http://{host}:{port} (model {name}; engine pid{'s' * (len(engines) > 1)} "
              f"{pids}, API pids {' '.join(str(p.pid) for p in apis)})", flush=True)
        return _watch(engines, apis, stopping)
    finally:
        _stop(apis or [], engines)
        for s, handler in previous.items():
            signal.signal(s, handler)
        addresses.remove()
        if metrics_dir:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def engine_setups(config, args, visible: list[str] | None = None) -> list[tuple]:
    """(EngineConfig, environment) of each engine process. Several engines: each takes a GPU of its own
    (CUDA_VISIBLE_DEVICES), or with --data-parallel-share-device a 1/N share of one GPU's KV memory. `visible`:
    the GPUs (default: as CUDA sees them). Raises ValueError naming what cannot be run."""
    n = args.data_parallel_size
    if n < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {n}")
    if n == 1:
        return [(config, {})]
    if config.tensor_parallel_size > 1:
        raise ValueError("--data-parallel-size with --tensor-parallel-size > 1 is not supported: run tensor-parallel "
                         "replicas behind a gateway (docs/scale_out.md)")
    if config.kv_events_endpoint:
        raise ValueError("--kv-events-endpoint names one socket, and --data-parallel-size starts several engines: "
                         "run one `specdec serve` a GPU for a router that reads KV events (docs/scale_out.md)")
    envs: list[dict] = [{} for _ in range(n)]
    if config.torch_device().type == "cuda":
        visible = _visible_gpus() if visible is None else visible
        if args.data_parallel_share_device:
            config = dataclasses.replace(config, kv_cache_memory_fraction=config.kv_cache_memory_fraction / n)
        elif n > len(visible):
            raise ValueError(f"--data-parallel-size {n} needs {n} GPUs and {len(visible)} are visible "
                             f"(CUDA_VISIBLE_DEVICES); --data-parallel-share-device runs them all on one")
        else:
            envs = [{"CUDA_VISIBLE_DEVICES": visible[i]} for i in range(n)]
    return [(config, env) for env in envs]


def _visible_gpus() -> list[str]:
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    import torch
    return [str(i) for i in range(torch.cuda.device_count())]


@contextmanager
def _environ(extra: dict):
    """os.environ with `extra` while a spawned child starts (it copies the environment then)."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _spawn_engine(ctx, config, env, args, addresses, index: int):
    ready_r, ready_w = ctx.Pipe(duplex=False)
    alive_r, alive_w = ctx.Pipe(duplex=False)
    engine = ctx.Process(target=engine_process.main, name=f"specdec-engine-{index}",
                         args=(config, args.max_queued, addresses, args.api_server_count, ready_w, alive_w, index))
    with _environ(env):
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


def _start_apis(ctx, args, addresses, port, alives):
    """The API processes, each waiting on its pipe of `infos` for the engines' ModelInfo."""
    ready_r, ready_w = ctx.Pipe(duplex=False)
    apis, infos = [], []
    for client in range(args.api_server_count):
        info_r, info_w = ctx.Pipe(duplex=False)
        p = ctx.Process(target=api_process.main, name=f"specdec-api-{client}",
                        args=(vars(args), info_r, addresses, client, port, alives, ready_w))
        p.start()
        info_r.close()
        apis.append(p)
        infos.append(info_w)
    ready_w.close()
    return apis, infos, ready_r


def _wait_ready(apis, ready_r, engines, stopping) -> bool:
    waiting, count = [p.sentinel for p in apis + engines], 0
    while count < len(apis):
        if stopping:
            return False
        for obj in wait([ready_r, *waiting], timeout=0.5):
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


def _watch(engines, apis, stopping) -> int:
    code, left = 0, len(engines)
    sentinels = {p.sentinel: p for p in engines + apis}
    while not stopping:
        for obj in wait(list(sentinels), timeout=0.5):
            proc = sentinels.pop(obj)
            if proc in engines:       # the API processes use the others, or answer 503 once none is left
                left -= 1
                print(f"specdec serve: engine process {proc.name} exited (exit code {proc.exitcode}); "
                      f"{left} left", file=sys.stderr)
                code = 1
            else:
                print(f"specdec serve: API process {proc.name} exited (exit code {proc.exitcode}); stopping",
                      file=sys.stderr)
                return 1
    return code


def _stop(apis, engines) -> None:
    """API processes first (uvicorn finishes its responses), then the engines; whatever lingers is killed."""
    for group in (apis, engines):
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
