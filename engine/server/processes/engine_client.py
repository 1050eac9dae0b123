"""An API process's handle on the engine process: the interface of AsyncEngine (submit, abort, guides, stats,
healthy), over ZeroMQ (engine/server/processes/ipc.py).

Outputs come back as token ids; this process turns them into text (`TextStream`), so detokenization costs the
engine nothing. A choice with stop strings is the exception: the engine must read its text to stop on it, and
sends that text along.

Invariants:
- Only the event loop touches the sockets, `_subs` and the waiters; one task (`_read`) receives.
- The engine is gone when `alive` (a pipe only the engine process writes to) reads EOF, or when it says so
  (`Fatal`): every open request then ends with an error naming it (503) and later ones get 503.
"""
from __future__ import annotations

import asyncio
import itertools
import traceback

import zmq
import zmq.asyncio

from engine.guided.compile_pool import CompileBusy
from engine.requests.output import IncrementalDetokenizer, RequestOutput
from engine.server.metrics import DEAD_STATS
from engine.server.processes import ipc
from engine.server.processes.submission import ENGINE_STOPPED, EngineDead, Overloaded, Router, Submission

STATS_TIMEOUT_S = 5.0
GONE_GRACE_S = 0.3          # after the engine process is seen gone, for its last frames to arrive


class TextStream:
    """One choice's text from its token ids, as the engine would have made it: the ids a request ends on (EOS,
    a stop token id) are not text, and the detokenizer's held tail is released at the end."""

    def __init__(self, tokenizer, params, eos_ids: frozenset[int]):
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None and not params.stop else None
        self.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_ids)
        self.finished = False

    def output(self, item: ipc.Out) -> RequestOutput:
        self.finished = item.finished
        ids = item.new_ids
        if item.text is not None or self.detok is None:
            text = item.text or ""
        else:
            last = len(ids) - (item.finished and item.reason == "stop" and bool(ids) and ids[-1] in self.stop_ids)
            add = self.detok.add
            text = "".join([add(t) for t in ids[:last]])
            if item.finished:
                text += self.detok.flush()
        return RequestOutput(item.sub, tuple(ids), text, item.finished, item.reason, item.error, spec=item.spec,
                             logprobs=item.logprobs, cached_tokens=item.cached, prompt_logprobs=item.prompt_lp,
                             closed_by=item.closed_by)


class EngineClient(Router):
    def __init__(self, addresses: ipc.Addresses, client: int, info: ipc.ModelInfo, tokenizer, alive,
                 stream_interval: int = 0):
        super().__init__(stream_interval)
        self.addresses, self.client, self.info, self.tokenizer, self._alive = addresses, client, info, tokenizer, alive
        self.eos_ids = frozenset(info.eos_ids)
        self.guides = RemoteGuides(self)
        self.started = info.started
        self.error: str | None = None
        self._subs: dict[int, tuple[Submission, list[TextStream]]] = {}
        self._waiters: dict[tuple[str, int], asyncio.Future] = {}     # ("stats" | "compile", token) -> reply
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._sync, self._async = zmq.Context(), zmq.asyncio.Context()
        self._push = self._sync.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(self.addresses.inbox)
        self._pull = self._async.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self.addresses.outbox(self.client))
        self._reader = loop.create_task(self._read())
        loop.add_reader(self._alive.fileno(), self._engine_gone)

    def shutdown(self) -> None:
        """From a worker thread at exit (as AsyncEngine.shutdown): the sockets go with the process."""

    def healthy(self) -> bool:
        return self.error is None

    # ---- requests --------------------------------------------------------------------------------------------
    async def submit(self, prompt_ids: list[int], params: list, stream: bool = True) -> Submission:
        """Add one request per SamplingParams (all or none). Raises Overloaded, EngineDead, or the ValueError
        that names what is wrong with the request."""
        if self.error is not None:
            raise EngineDead(f"{ENGINE_STOPPED}: {self.error}")
        sid = next(self._ids)
        sub = Submission(prompt_ids, params, stream, added=self._loop.create_future(), open_choices=len(params), id=sid)
        self._subs[sid] = (sub, [TextStream(self.tokenizer, p, self.eos_ids) for p in params])
        self.live += len(params)
        self._send(ipc.Add(self.client, sid, list(prompt_ids), [ipc.params_to_wire(p) for p in params]))
        try:
            code, message = await asyncio.shield(sub.added)
        except asyncio.CancelledError:        # the client left before the engine answered: undo once it has
            sub.added.add_done_callback(lambda _: self._added_late(sub))
            raise
        if code:
            self._forget(sid)
            raise {"invalid": ValueError, "overloaded": Overloaded}.get(code, EngineDead)(message)
        return sub

    def _added_late(self, sub: Submission) -> None:
        if sub.added.result()[0]:
            self._forget(sub.id)
        else:
            self.abort(sub)

    def abort(self, sub: Submission) -> None:
        """The client went away: end whatever of it still runs (its KV pages go back)."""
        if sub.open_choices and self.error is None:
            self._send(ipc.Abort(self.client, sub.id))

    def _forget(self, sid: int) -> None:
        entry = self._subs.pop(sid, None)
        if entry is not None:
            self.live -= entry[0].open_choices

    def _send(self, msg) -> None:
        self._push.send(ipc.encode(msg))

    # ---- replies ---------------------------------------------------------------------------------------------
    async def _read(self) -> None:
        decode = ipc.client_decoder().decode
        while True:
            frame = await self._pull.recv()
            try:
                self._dispatch(decode(frame))
            except Exception:                 # a bug: say so, and go on serving the others
                traceback.print_exc()

    def _dispatch(self, msg) -> None:
        if isinstance(msg, ipc.Outputs):
            self._outputs(msg.items)
        elif isinstance(msg, ipc.Added):
            entry = self._subs.get(msg.sub)
            if entry is not None and not entry[0].added.done():
                entry[0].added.set_result((msg.code, msg.message))
        elif isinstance(msg, ipc.Compiled):
            self._answer(("compile", msg.token), (msg.code, msg.message, msg.minimum))
        elif isinstance(msg, ipc.StatsReply):
            self._answer(("stats", msg.token), msg.stats)
        elif isinstance(msg, ipc.Fatal):
            self._die(msg.message)

    def _outputs(self, items: list) -> None:
        batch = []
        for item in items:
            entry = self._subs.get(item.sub)
            if entry is None:
                continue
            sub, streams = entry
            batch.append((sub, item.choice, streams[item.choice].output(item)))
            if item.finished and all(s.finished for s in streams):
                del self._subs[item.sub]
        self.route(batch)

    def _answer(self, key, value) -> None:
        waiter = self._waiters.pop(key, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(value)

    def _expect(self, kind: str, make) -> tuple[int, asyncio.Future]:
        """Send make(token); -> the token and the future its reply (or EngineDead) resolves."""
        token = next(self._ids)
        waiter = self._waiters[(kind, token)] = self._loop.create_future()
        self._send(make(token))
        return token, waiter

    async def stats(self) -> dict:
        if self.error is not None:
            return DEAD_STATS
        token, waiter = self._expect("stats", lambda t: ipc.Stats(self.client, t))
        try:
            return await asyncio.wait_for(waiter, STATS_TIMEOUT_S)
        except (asyncio.TimeoutError, EngineDead):
            return dict(DEAD_STATS, up=float(self.error is None))
        finally:
            self._waiters.pop(("stats", token), None)

    async def reset_prefix_cache(self) -> int:
        """Forget the prefix cache's unheld pages; returns how many. Raises EngineDead."""
        if self.error is not None:
            raise EngineDead(f"the engine has stopped: {self.error}")
        token, waiter = self._expect("stats", lambda t: ipc.ResetCache(self.client, t))
        try:
            return (await asyncio.wait_for(waiter, STATS_TIMEOUT_S))["reset_pages"]
        except asyncio.TimeoutError:
            raise EngineDead("the engine did not answer") from None
        finally:
            self._waiters.pop(("stats", token), None)

    # ---- the engine's end ------------------------------------------------------------------------------------
    def _engine_gone(self) -> None:
        """The pipe closed: the engine process is gone. Its last frames (a `Fatal` saying why) may still be on
        their way through the socket, so the verdict waits for them a moment."""
        self._loop.remove_reader(self._alive.fileno())
        self._loop.call_later(GONE_GRACE_S, self._die, "the engine process exited")

    def _die(self, message: str) -> None:
        if self.error is None:
            self.error = message
        batch, error = [], f"{ENGINE_STOPPED}: {self.error}"
        for sub, streams in list(self._subs.values()):
            if not sub.added.done():
                sub.added.set_result(("dead", error))       # its submit forgets it
                continue
            for choice, stream in enumerate(streams):
                if not stream.finished:
                    batch.append((sub, choice, RequestOutput(sub.id, (), "", True, "error", error)))
            del self._subs[sub.id]
        if batch:
            self.route(batch)
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(EngineDead(error))


class RemoteGuides:
    """Compiles on the engine process's grammar service (where the grammars are used)."""

    def __init__(self, client: EngineClient):
        self.client, self.timeout_s = client, client.info.compile_timeout_s

    def start(self, guide, owner) -> "_RemoteTicket":
        if self.client.error is not None:
            raise EngineDead(f"{ENGINE_STOPPED}: {self.client.error}")
        return _RemoteTicket(self.client, guide, owner)


class _RemoteTicket:
    def __init__(self, client: EngineClient, guide, owner):
        self.client = client
        self.token, self.done = client._expect(
            "compile", lambda token: ipc.Compile(client.client, token, ipc.guide_to_wire(guide), owner))

    def finished(self) -> bool:
        return self.done.done()

    def cancel(self) -> None:
        self.client._waiters.pop(("compile", self.token), None)
        if self.client.error is None:
            self.client._send(ipc.CancelCompile(self.client.client, self.token))

    async def result(self) -> int | None:
        """The guide's shortest whole output in tokens (None: not known), once it compiled."""
        code, message, minimum = await self.done    # raises EngineDead if the engine went first
        if code == "busy":
            raise CompileBusy(message)
        if code != "ok":
            raise ValueError(message)
        return minimum or None
