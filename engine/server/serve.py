"""`specdec serve`: engine processes (one, or --data-parallel-size) and API processes in front of them
(engine/server/processes/supervisor.py), or with --single-process the engine on a thread beside the app. Port 0
picks a free port; the "listening" line names the real one once requests can be served."""
from __future__ import annotations

import argparse
import os
import sys

from engine.server.api.limits import DEFAULT_MAX_BODY_BYTES
from engine.server.openai.tool_formats import NAMES as TOOL_FORMATS


# two busy threads (the engine's loop and the event loop's): the engine gets the GIL back sooner (measured)
SERVER_DEFAULTS = {"switch_interval": (5e-5, "the engine shares the GIL with the server's threads"),
                   "grammar_compile_processes": (True, "a client's compile must not slow the others, and one given up "
                                                       "on must stop")}


def add_server_options(p: argparse.ArgumentParser) -> None:
    """The server's own options; the engine's come from engine/options.py."""
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed when ready)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model ids clients may send; responses carry the first (default: the model's name)")
    p.add_argument("--max-queued", type=int, default=256,
                   help="requests that may wait beyond --max-num-seqs before the server answers 429")
    p.add_argument("--stream-interval", type=int, default=0, metavar="N",
                   help="tokens per streamed chunk (0: auto, one token until 8 streams are active, then more)")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="largest request body accepted (larger: 413 before it is parsed)")
    p.add_argument("--request-read-timeout", type=float, default=30.0, metavar="S",
                   help="a request must arrive whole (headers and body) within this of its first byte, else 408 and "
                        "the connection is closed")
    p.add_argument("--max-connections-per-client", type=int, default=256, metavar="N",
                   help="open connections one peer address may hold (per API process); more get 429 at once. 0: no "
                        "cap. Behind a proxy every client is the proxy's address")
    p.add_argument("--client-key-header", default=None, metavar="NAME",
                   help="take a request's client, for its share of the grammar compiles, from this header (e.g. a "
                        "gateway's user header) instead of its address; only behind a proxy that sets it")
    p.add_argument("--allow-cache-reset", action="store_true",
                   help="add POST /reset_prefix_cache, which forgets every cached prompt page no request holds (for "
                        "benchmarks and operators; any client reaching the server could call it)")
    p.add_argument("--api-server-count", type=int, default=None, metavar="N",
                   help="API processes (HTTP, templates, tokenization, SSE) in front of the engine processes; "
                        "default: one per 64 of --max-num-seqs, at most 4 and a quarter of the CPU cores "
                        "(docs/server.md)")
    p.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="engine processes, one a GPU, behind the same API processes; each request goes to the one "
                        "whose prefix cache holds the most of its prompt, else to the least loaded")
    p.add_argument("--data-parallel-share-device", action="store_true",
                   help="run the --data-parallel-size engines on one GPU, each with 1/N of the KV memory (for tests "
                        "and overhead measurements)")
    p.add_argument("--single-process", action="store_true",
                   help="run the engine on a thread of the one HTTP process instead of a process of its own")
    p.add_argument("--tool-call-parser", default="auto", choices=["auto", *TOOL_FORMATS],
                   help="how the model writes tool calls (auto: from its chat template; hermes where it shows none)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])


def build_state(args):
    from engine.options import engine_config
    from engine.llm_engine import LLMEngine
    from engine.models.loader import load_tokenizer
    from engine.server.api.app import ServerState
    from engine.server.processes.async_engine import AsyncEngine

    engine = LLMEngine(engine_config(args))
    engine.guided.ensure_service()          # before any handler thread may compile with it
    tokenizer = load_tokenizer(engine.tokenizer_source)
    aengine = AsyncEngine(engine, max_queued=args.max_queued, stream_interval=args.stream_interval)
    return ServerState.for_engine(args, aengine, tokenizer)


def auto_api_servers(max_num_seqs: int, cpu_count: int) -> int:
    """API processes for a server of `max_num_seqs` streams on `cpu_count` cores: one streams about 64 of a small
    model's concurrent streams before it, not the engine, sets the pace; each takes a core, and the engine
    process and its compile workers need theirs."""
    return max(1, min(4, max_num_seqs // 64, cpu_count // 4))


def cmd_serve(args) -> int:
    if args.max_queued < 0 or args.stream_interval < 0:
        raise ValueError("--max-queued and --stream-interval must be >= 0")
    if args.api_server_count is None:
        from engine.options import engine_config
        seqs = engine_config(args).max_num_seqs
        args.api_server_count = 1 if args.single_process else auto_api_servers(seqs, os.cpu_count() or 1)
    if args.api_server_count < 1:
        raise ValueError("--api-server-count must be >= 1")
    from engine.server.api.connections import ConnectionGuard
    ConnectionGuard.from_args(args)             # its bounds are checked before any process starts
    if args.single_process:
        if args.api_server_count != 1:
            raise ValueError("--single-process runs one API server: drop --api-server-count")
        if args.data_parallel_size != 1:
            raise ValueError("--single-process runs one engine on a thread: drop --data-parallel-size")
        return serve_in_process(args)
    from engine.server.processes.supervisor import run
    return run(args)


def serve_in_process(args) -> int:
    """The engine on a thread of the HTTP process (one GIL for both): for tests and side-by-side measurements."""
    from engine.server.api import graceful
    from engine.server.processes.api_process import bind
    from engine.server.api.app import create_app
    from engine.server.api.connections import ConnectionGuard
    guard = ConnectionGuard.from_args(args)
    sock = bind(args.host, args.port)             # before the model loads: a port in use fails at once
    state = build_state(args)
    host, port = sock.getsockname()[:2]
    state.on_ready = lambda: print(f"specdec serve: listening on http://{host}:{port} (model {state.model_name})",
                                   flush=True)
    try:
        graceful.run(create_app(state), [sock], args.log_level, guard.protocol(), state.aengine.end_all)
    except KeyboardInterrupt:                   # uvicorn re-raises the signal once it has shut down
        pass
    if state.aengine.error:
        print(f"specdec serve: the engine stopped: {state.aengine.error}", file=sys.stderr)
        return 1
    return 0
