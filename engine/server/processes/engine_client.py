"""An API process's handle on the engine processes: the interface of AsyncEngine (place, submit, abort, guides,
stats, healthy), over ZeroMQ (engine/server/processes/ipc.py). With several engines (--data-parallel-size) each
request goes where `Placement` says (engine/server/processes/placement.py) and stays there.

Outputs come back as token ids; this process turns them into text (`TextStream`), so detokenization costs the
engine nothing. A choice with stop strings is the exception: the engine must read its text to stop on it, and
sends that text along.

Invariants:
- Only the event loop touches the sockets, `_subs` and the waiters; one task (`_read`) receives.
- An engine is gone when its `alive` pipe (only that engine process writes to it) reads EOF, or when it says so
  (`Fatal`): every open request on it then ends with an error naming it, and later ones go to the others. With
  none left every request gets 503.
"""
from __future__ import annotations

import asyncio
import itertools
import traceback

import zmq
import zmq.asyncio

from engine.requests.output import IncrementalDetokenizer, RequestOutput
from engine.server.metrics import DEAD_STATS, combine_stats
from engine.server.processes import ipc
from engine.server.processes.placement import Placement, start_following
from engine.server.processes.remote_guides import RemoteGuides
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

    def tokens(self, sub: int, ids: list[int]) -> RequestOutput:
        """An output that brings only new ids (the columns of ipc.Outputs): never a choice's last."""
        return RequestOutput(sub, tuple(ids), "" if self.detok is None else self._text(ids), False)

    def _text(self, ids) -> str:
        add = self.detok.add
        return "".join([add(t) for t in ids])

    def output(self, item: ipc.Out) -> RequestOutput:
        self.finished = item.finished
        ids = item.new_ids
        if item.text is not None or self.detok is None:
            text = item.text or ""
        else:
            last = len(ids) - (item.finished and item.reason == "stop" and bool(ids) and ids[-1] in self.stop_ids)
            text = self._text(ids[:last])
            if item.finished:
                text += self.detok.flush()
        return RequestOutput(item.sub, tuple(ids), text, item.finished, item.reason, item.error, spec=item.spec,
                             logprobs=item.logprobs, cached_tokens=item.cached, prompt_logprobs=item.prompt_lp,
                             closed_by=item.closed_by)


class EngineClient(Router):
    def __init__(self, addresses: ipc.Addresses, client: int, info: ipc.ModelInfo, tokenizer, alives: list,
                 stream_interval: int = 0):
        super().__init__(stream_interval)
        self.addresses, self.client, self.info, self.tokenizer = addresses, client, info, tokenizer
        self._alives = list(alives)
        self.placement = Placement(len(self._alives), info.block_size)
        self.eos_ids = frozenset(info.eos_ids)
        self.guides = RemoteGuides(self)
        self.started = info.started
        self.error: str | None = None
        self._subs: dict[int, tuple[Submission, list[TextStream], int]] = {}     # id -> (.., .., its engine)
        self._waiters: dict[tuple[str, int], tuple[asyncio.Future, int]] = {}   # (kind, token) -> (reply, engine)
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._sync, self._async = zmq.Context(), zmq.asyncio.Context()
        self._pushes = []
        for engine in range(len(self._alives)):
            push = self._sync.socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 0)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(self.addresses.inbox(engine))
            self._pushes.append(push)
        self._pull = self._async.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self.addresses.outbox(self.client))
        self._reader = loop.create_task(self._read())
        for engine, alive in enumerate(self._alives):
            loop.add_reader(alive.fileno(), self._engine_gone, engine)
        if len(self._alives) > 1 and self.info.prefix_caching:
            self._followers = start_following(self.placement, [self.addresses.kv_events(i) for i in
                                                               range(len(self._alives))], self._async, loop)

    def shutdown(self) -> None:
        """From a worker thread at exit (as AsyncEngine.shutdown): the sockets go with the process."""

    def healthy(self) -> bool:
        return self.error is None

    # ---- requests --------------------------------------------------------------------------------------------
    def place(self, prompt_ids: list[int]) -> int:
        """The engine process for a request of this prompt (its compile and its submission go there). Raises
        EngineDead when none is left."""
        if self.error is not None:
            raise EngineDead(f"{ENGINE_STOPPED}: {self.error}")
        if len(self._alives) == 1:
            return 0
        return self.placement.choose(prompt_ids)

    async def submit(self, prompt_ids: list[int], params: list, stream: bool = True,
                     engine: int | None = None) -> Submission:
        """Add one request per SamplingParams (all or none) on `engine` (None, or one gone since: placed now).
        Raises Overloaded, EngineDead, or the ValueError that names what is wrong with the request."""
        if engine is None or self.placement.dead[engine]:
            engine = self.place(prompt_ids)
        if self.error is not None:
            raise EngineDead(f"{ENGINE_STOPPED}: {self.error}")
        sid = next(self._ids)
        sub = Submission(prompt_ids, params, stream, added=self._loop.create_future(), open_choices=len(params), id=sid)
        self._subs[sid] = (sub, [TextStream(self.tokenizer, p, self.eos_ids) for p in params], engine)
        self.live += len(params)
        self.placement.load[engine] += len(params)
        self._send(ipc.Add(self.client, sid, list(prompt_ids), [ipc.params_to_wire(p) for p in params]), engine)
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
        entry = self._subs.get(sub.id)
        if sub.open_choices and entry is not None and not self.placement.dead[entry[2]]:
            self._send(ipc.Abort(self.client, sub.id), entry[2])

    def _forget(self, sid: int) -> None:
        entry = self._subs.pop(sid, None)
        if entry is not None:
            self.live -= entry[0].open_choices
            self.placement.load[entry[2]] -= entry[0].open_choices

    def _send(self, msg, engine: int = 0) -> None:
        self._pushes[engine].send(ipc.encode(msg))

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
            self._outputs(msg)
        elif isinstance(msg, ipc.Added):
            entry = self._subs.get(msg.sub)
            if entry is not None and not entry[0].added.done():
                entry[0].added.set_result((msg.code, msg.message))
        elif isinstance(msg, ipc.Compiled):
            self._answer(("compile", msg.token), (msg.code, msg.message, msg.minimum))
        elif isinstance(msg, ipc.StatsReply):
            self._answer(("stats", msg.token), msg.stats)
        elif isinstance(msg, ipc.Fatal):
            self._lose(msg.engine, msg.message)

    def _outputs(self, frame: ipc.Outputs) -> None:
        batch, load, at = [], self.placement.load, 0
        for sub_id, choice, count in zip(frame.subs, frame.choices, frame.counts):
            entry = self._subs.get(sub_id)
            at += count
            if entry is not None:
                batch.append((entry[0], choice, entry[1][choice].tokens(sub_id, frame.ids[at - count:at])))
        for item in frame.items:
            entry = self._subs.get(item.sub)
            if entry is None:
                continue
            sub, streams, engine = entry
            batch.append((sub, item.choice, streams[item.choice].output(item)))
            if item.finished:
                load[engine] -= 1
                if all(s.finished for s in streams):
                    del self._subs[item.sub]
        self.route(batch)

    def _answer(self, key, value) -> None:
        waiter, _ = self._waiters.pop(key, (None, 0))
        if waiter is not None and not waiter.done():
            waiter.set_result(value)

    def _expect(self, kind: str, make, engine: int = 0) -> tuple[int, asyncio.Future]:
        """Send make(token) to `engine`; -> the token and the future its reply (or EngineDead) resolves."""
        token = next(self._ids)
        waiter = self._loop.create_future()
        self._waiters[(kind, token)] = (waiter, engine)
        self._send(make(token), engine)
        return token, waiter

    async def _ask_all(self, make) -> dict[int, dict]:
        """{engine: make(token)'s StatsReply} from every engine left, in one wait; a timeout or a death raises."""
        engines = self.placement.alive()
        asked = [self._expect("stats", make, engine) for engine in engines]
        try:
            return dict(zip(engines, await asyncio.wait_for(asyncio.gather(*(w for _, w in asked)), STATS_TIMEOUT_S)))
        finally:
            for token, _ in asked:
                self._waiters.pop(("stats", token), None)

    async def stats(self) -> dict:
        """The engines' stats added up; with several, each engine's under "engines" too (by its index)."""
        if self.error is not None:
            return DEAD_STATS
        try:
            replies = await self._ask_all(lambda t: ipc.Stats(self.client, t))
        except (asyncio.TimeoutError, EngineDead):
            return dict(DEAD_STATS, up=float(self.error is None))
        out = combine_stats(list(replies.values()))
        return dict(out, engines=replies) if len(self._alives) > 1 else out

    async def reset_prefix_cache(self) -> int:
        """Forget the prefix caches' unheld pages; returns how many. Raises EngineDead."""
        if self.error is not None:
            raise EngineDead(f"the engine has stopped: {self.error}")
        try:
            replies = await self._ask_all(lambda t: ipc.ResetCache(self.client, t))
        except asyncio.TimeoutError:
            raise EngineDead("the engine did not answer") from None
        return sum(r["reset_pages"] for r in replies.values())

    # ---- an engine's end -------------------------------------------------------------------------------------
    def _engine_gone(self, engine: int) -> None:
        """Its pipe closed: the engine process is gone. Its last frames (a `Fatal` saying why) may still be on
        their way through the socket, so the verdict waits for them a moment."""
        self._loop.remove_reader(self._alives[engine].fileno())
        self._loop.call_later(GONE_GRACE_S, self._lose, engine, "the engine process exited")

    def _lose(self, engine: int, message: str) -> None:
        """Engine `engine` stopped: its requests and questions fail with `message`; the last one: all do."""
        if self.placement.dead[engine]:
            return
        self.placement.forget(engine)
        if not self.placement.alive():
            self._die(message)
        else:
            self._fail(f"{ENGINE_STOPPED}: {message}", engine)

    def _die(self, message: str) -> None:
        if self.error is None:
            self.error = message
        self._fail(f"{ENGINE_STOPPED}: {self.error}")

    def end_all(self, message: str) -> None:
        """Loop thread, at shutdown: every open request ends with `message` (503), its engine told to stop it."""
        for sub, _, _ in list(self._subs.values()):
            if sub.added.done():
                self.abort(sub)
        self._fail(f"{ENGINE_STOPPED}: {message}")

    def _fail(self, error: str, engine: int | None = None) -> None:
        """End the requests and questions on `engine` (None: on every engine) with `error`."""
        for waiter, on in self._waiters.values():
            if (engine is None or on == engine) and not waiter.done():
                waiter.set_exception(EngineDead(error))
        batch = []
        for sid in [sid for sid, entry in self._subs.items() if engine is None or entry[2] == engine]:
            sub, streams, on = self._subs[sid]
            if not sub.added.done():
                sub.added.set_result(("dead", error))       # its submit forgets it
                continue
            for choice, stream in enumerate(streams):
                if not stream.finished:
                    batch.append((sub, choice, RequestOutput(sub.id, (), "", True, "error", error)))
            del self._subs[sid]
            self.placement.load[on] -= sub.open_choices     # (route counts them off `live`)
        if batch:
            self.route(batch)
