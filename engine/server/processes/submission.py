"""What the HTTP side holds of a request while the engine runs it, whichever way the engine is reached (a thread
of this process, engine/server/processes/async_engine.py, or an engine process,
engine/server/processes/engine_client.py).

Invariant: only the event loop touches a `Submission` and `Router.live`; outputs reach it in per-step batches.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from engine.requests.output import RequestOutput

ENGINE_STOPPED = "the engine stopped"     # the start of the error of a request the engine's end cut short
CHUNKS_PER_STEP = 4        # stream chunks the event loop sends per engine step before chunks grow (auto)


class Overloaded(Exception):
    """The bounded queue is full (HTTP 429)."""


class EngineDead(Exception):
    """The engine has stopped (HTTP 503)."""


@dataclass(eq=False)
class Submission:
    """One HTTP request's choices. Their outputs collect in `pending`, as (choice index, RequestOutput);
    `ready` is set when the consumer should take them (see Router.route)."""
    prompt_ids: list[int]
    params: list                                   # one SamplingParams per choice
    stream: bool = True                            # False: wake the consumer only once every choice finished
    added: asyncio.Future | None = None            # the engine's answer to the add
    request_ids: list[int] = field(default_factory=list)
    open_choices: int = 0
    pending: list = field(default_factory=list)
    pending_tokens: int = 0
    woken: bool = False                            # the first tokens went out at once (time to first token)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    id: int = -1                                   # its id on the wire (engine process only)

    async def next_batch(self) -> list[tuple[int, RequestOutput]]:
        await self.ready.wait()
        self.ready.clear()
        batch, self.pending, self.pending_tokens = self.pending, [], 0
        return batch


class Router:
    """Hands a step's outputs to their submissions and decides when each consumer wakes."""

    def __init__(self, stream_interval: int = 0):
        self.stream_interval = stream_interval         # tokens per chunk; 0: auto (see _interval)
        self.live = 0                                  # choices submitted here and not finished

    def _interval(self, active: int) -> int:
        """Tokens a stream collects before its consumer wakes. Every chunk costs the event loop time; past
        CHUNKS_PER_STEP active streams, chunks carry more tokens so that the loop's share of a step stays
        bounded (with the loop in the engine's process, one token a chunk at many streams starved the compute
        stream; docs/server.md)."""
        if self.stream_interval:
            return self.stream_interval
        return -(-active // CHUNKS_PER_STEP)

    def route(self, batch: list) -> None:
        """batch: (submission, choice, RequestOutput) for one step."""
        touched = {}
        for sub, choice, out in batch:
            if out.finished:
                sub.open_choices -= 1
                self.live -= 1
            sub.pending.append((choice, out))
            sub.pending_tokens += len(out.new_token_ids)
            touched[sub] = touched.get(sub, False) or out.finished
        interval = self._interval(len(touched))
        for sub, finished in touched.items():
            if not sub.open_choices or sub.stream and (finished or not sub.woken or sub.pending_tokens >= interval):
                sub.woken = True
                sub.ready.set()
