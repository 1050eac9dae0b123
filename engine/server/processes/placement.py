"""Which engine process a request goes to, with `--data-parallel-size N`: the one whose prefix cache holds the
most of its prompt, else the least loaded.

Each engine publishes its cached pages as KV events (engine/memory/kv_events.py) on an IPC socket of its own; every
API process subscribes to all of them and keeps each engine's set of page digests. A prompt's digests are the
engine's own (engine/memory/block_manager.py prefix_digests), so a match here is a page that engine would map
instead of computing. The view lags an engine by the events in flight: a request right behind another with the same
prompt may not see its pages yet, and goes by load.

Invariants: only the API process's event loop touches a `Placement` (its subscriber task and the routes), and a
dead engine is never chosen.
"""
from __future__ import annotations

import asyncio
import traceback

import msgspec

from engine.memory.block_manager import ROOT, prefix_digests
from engine.memory.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


class Placement:
    def __init__(self, engines: int, block_size: int):
        self.block_size = block_size
        self.cached: list[set[bytes]] = [set() for _ in range(engines)]
        self.load = [0] * engines           # this API process's unfinished choices on each engine
        self.dead = [False] * engines
        self._turn = 0                      # ties by load go round, so an idle server spreads new prompts

    def alive(self) -> list[int]:
        return [i for i, dead in enumerate(self.dead) if not dead]

    def choose(self, prompt: list[int]) -> int:
        """The engine for `prompt`. Raises LookupError when every engine is dead."""
        alive = self.alive()
        if not alive:
            raise LookupError("every engine process has stopped")
        digests = prefix_digests(prompt, self.block_size, ROOT) if any(self.cached[i] for i in alive) else []
        best = max(alive, key=lambda i: self.matched(i, digests))
        if digests and self.matched(best, digests):
            return best
        least = min(self.load[i] for i in alive)
        tied = [i for i in alive if self.load[i] == least]
        self._turn += 1
        return tied[self._turn % len(tied)]

    def matched(self, engine: int, digests: list[bytes]) -> int:
        """Leading pages of `digests` that `engine` holds."""
        cached, n = self.cached[engine], 0
        for d in digests:
            if d not in cached:
                break
            n += 1
        return n

    def apply(self, engine: int, batch: KVEventBatch) -> None:
        cached = self.cached[engine]
        for event in batch.events:
            if isinstance(event, BlockStored):
                cached.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                cached.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                cached.clear()

    def forget(self, engine: int) -> None:
        """The engine is gone: never chosen again."""
        self.dead[engine] = True
        self.cached[engine].clear()


async def follow(placement: Placement, engine: int, socket) -> None:
    """Apply engine `engine`'s KV events from a connected, subscribed zmq.asyncio SUB socket, until cancelled. A
    gap in the sequence numbers (the engine dropped batches) leaves the view short of some pages: those requests
    go by load, which costs a prefill, never a wrong answer."""
    decode = msgspec.msgpack.Decoder(KVEventBatch).decode
    while True:
        _, _, payload = await socket.recv_multipart()
        try:
            placement.apply(engine, decode(payload))
        except Exception:                   # a bug: say so, and keep routing by what is known
            traceback.print_exc()


def start_following(placement: Placement, endpoints: list[str], context, loop: asyncio.AbstractEventLoop) -> list:
    """One SUB socket and task per engine; -> the tasks."""
    import zmq
    tasks = []
    for engine, endpoint in enumerate(endpoints):
        sock = context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        tasks.append(loop.create_task(follow(placement, engine, sock)))
    return tasks
