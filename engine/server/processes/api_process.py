"""An API process: the FastAPI app under uvicorn (parsing, chat templates, tokenization, tool parsing,
detokenization, SSE), in front of the engine process. Several may share one port (SO_REUSEPORT): the kernel
spreads connections over them."""
from __future__ import annotations

import argparse
import signal
import socket

from engine.server.processes import ipc


def main(options: dict, infos, addresses: ipc.Addresses, client: int, port: int, alives: list, ready) -> None:
    """Process entry. `infos` brings the engines' ModelInfo once they serve (these imports overlap their start-up;
    EOF: one failed, nothing to serve); `ready` gets the client index once this process serves; `alives[i]` reads
    EOF once engine process i is gone."""
    from engine.server.processes.engine_process import die_with_parent, freeze_heap
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)       # the supervisor stops this process (SIGTERM)
    from engine.server.api import graceful
    from engine.server.api.app import create_app
    try:
        info = infos.recv()
    except EOFError:
        return
    args = argparse.Namespace(**options)
    state = build_state(args, info, addresses, client, alives)

    def serving():
        freeze_heap()                   # the event loop's collections walk only what comes later
        ready.send(client)
    state.on_ready = serving
    sock = bind(args.host, port, reuse_port=True)
    from engine.server.api.connections import ConnectionGuard
    graceful.run(create_app(state), [sock], args.log_level, ConnectionGuard.from_args(args).protocol(),
                 state.aengine.end_all)


def build_state(args, info: ipc.ModelInfo, addresses: ipc.Addresses, client: int, alives: list):
    from engine.models.loader import load_tokenizer, resolve_model
    from engine.server.api.app import ServerState
    from engine.server.processes.engine_client import EngineClient

    # the engine resolved (and converted) the model already: this finds its directory
    tokenizer = load_tokenizer(resolve_model(info.tokenizer_path)) if info.tokenizer_path else None
    eclient = EngineClient(addresses, client, info, tokenizer, alives, stream_interval=args.stream_interval)
    return ServerState.for_engine(args, eclient, tokenizer)


def bind(host: str, port: int, reuse_port: bool = False, listen: bool = True) -> socket.socket:
    """Raises ValueError naming the address where it cannot be had (in use, a host not of this machine)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:                              # several API processes on one port
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    if listen:
        sock.listen(2048)
    sock.set_inheritable(True)
    return sock
