"""The engine on its own thread of the server's process (`specdec serve --single-process`); the HTTP event loop
reaches it only through thread-safe queues. The default is an engine process
(engine/server/processes/engine_process.py).

Invariants:
- Only `engine_thread` touches the LLMEngine (add_request, abort, step) and `_routes`.
- The event loop owns `live` and every `Submission`: the engine thread hands results back with
  `call_soon_threadsafe`, one call per step for all of that step's outputs.
- A request counts against capacity from `submit` until its final output reaches the event loop, so a
  full server answers 429 at once instead of queueing without end.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
import traceback

from engine.requests.output import RequestOutput
from engine.server.api.guides import LocalGuides
from engine.server.metrics import engine_stats
from engine.server.processes.ipc import model_info
from engine.server.processes.submission import ENGINE_STOPPED, EngineDead, Overloaded, Router, Submission

__all__ = ["AsyncEngine", "EngineDead", "Overloaded", "Submission"]


class AsyncEngine(Router):
    def __init__(self, engine, max_queued: int = 256, stream_interval: int = 0, idle_wait: float = 0.05):
        super().__init__(stream_interval)
        self.engine = engine
        self.info = model_info(engine)
        self.guides = LocalGuides(engine.guided)
        self.capacity = engine.config.max_num_seqs + max_queued
        self.error: str | None = None                  # why the engine thread stopped
        self.started = time.time()
        self._idle_wait = idle_wait
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._routes: dict[int, tuple[Submission, int]] = {}   # request id -> (submission, choice)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.engine_thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)

    # ---- event loop side ---------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.engine_thread.start()

    def healthy(self) -> bool:
        return self.error is None and self.engine_thread.is_alive()

    async def stats(self) -> dict:
        return engine_stats(self.engine, self.live, self.healthy())

    async def reset_prefix_cache(self) -> int:
        """Forget the prefix cache's unheld pages (on the engine thread); returns how many."""
        if not self.healthy():
            raise EngineDead(f"the engine has stopped: {self.error or 'not running'}")
        done = self._loop.create_future()
        self._send(("reset", done))
        return await done

    def place(self, prompt_ids: list[int]) -> None:
        """One engine: nothing to choose."""
        return None

    async def submit(self, prompt_ids: list[int], params: list, stream: bool = True, engine=None) -> Submission:
        """Add one request per SamplingParams (all or none). Raises Overloaded, EngineDead, or the ValueError
        that names what is wrong with the request."""
        if not self.healthy():
            raise EngineDead(f"the engine has stopped: {self.error or 'not running'}")
        if self.live + len(params) > self.capacity:
            raise Overloaded(f"the server is at capacity ({self.live} requests in progress, at most "
                             f"{self.capacity}); retry later")
        sub = Submission(prompt_ids, params, stream, added=self._loop.create_future(), open_choices=len(params))
        self.live += len(params)
        self._send(("add", sub))
        try:
            sub.request_ids = await asyncio.shield(sub.added)
        except asyncio.CancelledError:        # the client left before the engine took it: undo when it has
            sub.added.add_done_callback(lambda _: self._added_late(sub))
            raise
        except BaseException:
            self.live -= len(params)
            raise
        return sub

    def _added_late(self, sub: Submission) -> None:
        if sub.added.exception() is not None:
            self.live -= len(sub.params)
        else:
            sub.request_ids = sub.added.result()
            self.abort(sub)

    def abort(self, sub: Submission) -> None:
        """The client went away: end whatever of it still runs (its KV pages go back)."""
        if sub.open_choices and sub.request_ids:
            self._send(("abort", list(sub.request_ids)))

    def _send(self, command) -> None:
        self._commands.put(command)
        self._wake.set()

    @staticmethod
    def _resolve(future: asyncio.Future, result, exc) -> None:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)

    def end_all(self, message: str) -> None:
        """Loop thread, at shutdown: every open request ends with `message` (503) and leaves the engine."""
        self._send(("end", message))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._send(("stop", None))
        self.engine_thread.join(timeout)

    # ---- engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._drain():
                if self.engine.has_unfinished():
                    self._publish(self.engine.step())
                else:
                    self._wake.wait(self._idle_wait)
                    self._wake.clear()
        except Exception as exc:              # a bug, not a bad request (those fail alone inside step)
            self.error = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            self._fail_all(self.error)
        finally:
            self._abort_routes()

    def _abort_routes(self) -> None:
        for rid in list(self._routes):
            self.engine.abort(rid)

    def _drain(self) -> bool:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return True
            if kind == "stop":
                return False
            if kind == "add":
                self._add(arg)
            elif kind == "end":
                self._abort_routes()
                self._fail_all(arg)
            elif kind == "reset":
                self._loop.call_soon_threadsafe(self._resolve, arg, self.engine.reset_prefix_cache(), None)
            else:
                for rid in arg:
                    self.engine.abort(rid)

    def _add(self, sub: Submission) -> None:
        ids, exc = [], None
        try:
            for choice, params in enumerate(sub.params):
                ids.append(self.engine.add_request(sub.prompt_ids, params, stream=True))
                self._routes[ids[-1]] = (sub, choice)
        except Exception as err:              # all or none: undo the choices already added
            exc = err if isinstance(err, ValueError) else ValueError(f"{type(err).__name__}: {err}")
            for rid in ids:
                self.engine.abort(rid)
                self._routes.pop(rid, None)
        self._loop.call_soon_threadsafe(self._resolve, sub.added, ids, exc)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        batch = []
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:                 # an undone choice's abort, or a request nobody waits for
                continue
            batch.append((route[0], route[1], out))
            if out.finished:
                del self._routes[out.request_id]
        if batch:
            self._loop.call_soon_threadsafe(self.route, batch)

    def _fail_all(self, message: str) -> None:
        batch = [(sub, choice, RequestOutput(rid, (), "", True, "error", f"{ENGINE_STOPPED}: {message}"))
                 for rid, (sub, choice) in self._routes.items()]
        self._routes.clear()
        if batch:
            self._loop.call_soon_threadsafe(self.route, batch)
