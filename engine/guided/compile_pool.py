"""Threads compiling grammars, shared fairly between owners (a server's clients).

Queued compiles are taken round robin across owners, and an owner runs at most `threads - 1` at once (all of
them with one thread), so another owner's compile starts on a free thread however many one owner has queued.
Unfinished compiles are bounded: `queue` in all, beyond which `submit` raises CompileBusy, and an owner's share:
once no more than a quarter of the queue is free, an owner holding a quarter of it is refused too. A lone client
(or one gateway) may so fill three quarters, and a crowd of them still leaves room for another client. A queued
compile is cancelled with its future; a running one cannot be (xgrammar has no cancellation point) and runs to its
end.
"""
from __future__ import annotations

import collections
import threading
from concurrent.futures import Future


class CompileBusy(RuntimeError):
    """Too many grammars are compiling (in all, or for this owner): try again later (HTTP 429)."""


class CompilePool:
    def __init__(self, threads: int, queue: int):
        self.threads, self.queue = threads, queue
        self.owner_cap = max(1, threads - 1)           # running compiles of one owner
        self.owner_queue = max(1, queue // 4)          # unfinished compiles of one owner once the queue is crowded
        self._cond = threading.Condition()
        self._waiting: collections.OrderedDict = collections.OrderedDict()    # owner -> deque of (future, fn)
        self._running: collections.Counter = collections.Counter()
        self._unfinished: collections.Counter = collections.Counter()
        self._closed = False
        self._alive = 0         # worker threads: started on demand, gone once nothing is queued

    def submit(self, fn, owner, bounded: bool) -> Future:
        """Run fn() on a pool thread. bounded: refuse (CompileBusy) past the queue bounds."""
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the grammar compile pool is closed")
            if bounded and sum(self._unfinished.values()) >= self.queue:
                raise CompileBusy(f"{self.queue} grammars are compiling; try again shortly")
            crowded = sum(self._unfinished.values()) >= self.queue - self.owner_queue
            if bounded and crowded and self._unfinished[owner] >= self.owner_queue:
                raise CompileBusy(f"this client has {self._unfinished[owner]} grammars compiling and the queue is "
                                  f"nearly full; at most {self.owner_queue} a client then")
            self._unfinished[owner] += 1
            self._waiting.setdefault(owner, collections.deque()).append((future, fn))
            if self._alive < self.threads:
                self._alive += 1
                threading.Thread(target=self._work, name="grammar-compile", daemon=True).start()
            else:
                self._cond.notify()
        return future

    def unfinished(self) -> int:
        with self._cond:
            return sum(self._unfinished.values())

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for queue in self._waiting.values():
                for future, _ in queue:
                    future.cancel()
            self._waiting.clear()
            self._cond.notify_all()

    def _next(self):
        """Under the lock: the first owner in turn with a queued compile and a free share; it goes last."""
        for owner, queue in self._waiting.items():
            if self._running[owner] < self.owner_cap:
                future, fn = queue.popleft()
                if queue:
                    self._waiting.move_to_end(owner)
                else:
                    del self._waiting[owner]
                return owner, future, fn
        return None

    def _work(self) -> None:
        while True:
            with self._cond:
                job = self._next()
                while job is None and self._waiting and not self._closed:
                    self._cond.wait()           # queued compiles, all of owners at their share
                    job = self._next()
                if job is None:
                    self._alive -= 1
                    return
                owner, future, fn = job
                self._running[owner] += 1
            self._run(future, fn)
            with self._cond:
                self._running[owner] -= 1
                self._unfinished[owner] -= 1
                for counter in (self._running, self._unfinished):
                    if counter[owner] <= 0:
                        del counter[owner]
                self._cond.notify_all()     # an owner at its share may run its next compile now

    @staticmethod
    def _run(future: Future, fn) -> None:
        if not future.set_running_or_notify_cancel():
            return                          # cancelled while queued: never runs
        try:
            result = fn()
        except BaseException as exc:        # noqa: BLE001 - the future carries it to the request
            future.set_exception(exc)
        else:
            future.set_result(result)
