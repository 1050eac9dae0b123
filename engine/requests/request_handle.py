"""A request's own view of the engine: its outputs, in order, and nothing of anyone else's.

The engine appends each output to the handle's queue as the step that makes it ends (`LLMEngine._deliver`);
iterating drives `LLMEngine.step()` until the next output of this request is there. Several handles can be
iterated in turn on one thread: outputs of the others wait in their own queues. `close()` (also on leaving
a `with` block) aborts the request if it has not finished.
"""
from __future__ import annotations

from collections import deque


class RequestHandle:
    def __init__(self, engine, request_id: int, queue: deque):
        self._engine = engine
        self._queue = queue
        self.request_id = request_id
        self.finished = False

    def __iter__(self):
        return self

    def __next__(self):
        while not self._queue:
            if self.finished:
                raise StopIteration
            if not self._engine.has_unfinished():
                raise RuntimeError(f"request {self.request_id} has no output pending and the engine is idle")
            self._engine.step()
        out = self._queue.popleft()
        self.finished = self.finished or out.finished
        return out

    def poll(self) -> list:
        """The outputs that arrived so far, without driving the engine."""
        outs = list(self._queue)
        self._queue.clear()
        self.finished = self.finished or any(o.finished for o in outs)
        return outs

    def close(self) -> None:
        if not self.finished:
            self._engine.abort(self.request_id)
            self.finished = True
        self._engine._listeners.pop(self.request_id, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
        return False
