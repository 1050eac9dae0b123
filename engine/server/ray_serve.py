"""specdec as a Ray Serve application: each replica runs `specdec serve` on a GPU of its own, and Ray Serve's proxy
spreads requests over the replicas, restarts one whose server has exited, and scales them as configured.

    serve run engine.server.ray_serve:build_app replicas=2 gpus=1 args="--model Qwen/Qwen2.5-1.5B-Instruct"

A replica is the whole server (its engine process and API process, on a free local port), reached through a thin
forwarder: a request body and its response (whole or SSE) pass through unchanged, so every route and error of
docs/server.md holds. Needs `pip install "ray[serve]"` (not a dependency of specdec). No `from __future__ import
annotations` here: FastAPI must see `Request` itself in the forwarder's signature, as Ray hands the class over."""

import shlex
import subprocess
import sys
import threading

import httpx
from fastapi import FastAPI, Request
from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse
from ray import serve

START_TIMEOUT_S = 600.0
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}

forwarder = FastAPI()


@serve.deployment
@serve.ingress(forwarder)
class SpecdecReplica:
    def __init__(self, server_args: list[str]):
        self.proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--host", "127.0.0.1",
                                      "--port", "0", *server_args], stdout=subprocess.PIPE, text=True)
        self.url = self._wait_listening(self.proc)
        self.client = httpx.AsyncClient(base_url=self.url, timeout=None)

    @staticmethod
    def _wait_listening(proc: subprocess.Popen) -> str:
        """The server's URL from its "listening" line; RuntimeError if it exits or stays silent too long. A thread
        goes on draining its stdout, so that the pipe never fills."""
        found, listening = {}, threading.Event()

        def read():
            for line in proc.stdout:
                if not listening.is_set() and line.startswith("specdec serve: listening on "):
                    found["url"] = line.split()[4]
                    listening.set()
            listening.set()
        threading.Thread(target=read, daemon=True).start()
        listening.wait(START_TIMEOUT_S)
        if "url" not in found:
            proc.kill()
            raise RuntimeError(f"specdec serve did not start (exit code {proc.poll()})")
        return found["url"]

    @forwarder.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def forward(self, path: str, request: Request):
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        sent = self.client.build_request(request.method, f"/{path}", params=request.query_params,
                                         content=await request.body(), headers=headers)
        reply = await self.client.send(sent, stream=True)
        kept = {k: v for k, v in reply.headers.items() if k.lower() not in HOP_HEADERS}
        return StreamingResponse(reply.aiter_raw(), status_code=reply.status_code, headers=kept,
                                 background=BackgroundTask(reply.aclose))

    def check_health(self) -> None:
        """Ray Serve calls this periodically; raising makes it replace the replica."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"specdec serve exited with code {self.proc.returncode}")

    def __del__(self):
        if getattr(self, "proc", None) is not None and self.proc.poll() is None:
            self.proc.terminate()


def build_app(options: dict):
    """The application for `serve run`: `replicas` (default 1), `gpus` a replica (default 1; 0 on a CPU machine),
    `cpus` a replica (default 1), and `args`, the `specdec serve` options of every replica."""
    replicas, gpus = int(options.get("replicas", 1)), float(options.get("gpus", 1))
    if replicas < 1 or gpus < 0:
        raise ValueError(f"replicas must be >= 1 and gpus >= 0, got {replicas} and {gpus}")
    actor = {"num_gpus": gpus, "num_cpus": float(options.get("cpus", 1))}
    return SpecdecReplica.options(num_replicas=replicas, ray_actor_options=actor).bind(
        shlex.split(options.get("args", "")))
