"""The engine process: owns the GPU and runs only the loop. API processes reach it over ZeroMQ
(engine/server/processes/ipc.py); it never parses HTTP, renders templates, detokenizes streamed text or writes
SSE.

Invariants:
- One thread, the loop, touches the LLMEngine, every socket and every table here. Grammar-compile threads
  only queue replies (`_replies`) and wake the loop through `_wake_w`.
- A request counts against `capacity` from its add until its final output is sent, across every API process,
  so a full server answers 429 at once instead of queueing without end.
- This process ends with its parent (PR_SET_PDEATHSIG), so a killed server leaves nothing holding the GPU.
- What is alive once the engine is up (model, tokenizer, torch's modules: ~270 K objects) is frozen out of the
  garbage collector's reach (`freeze_heap`): a full collection would otherwise walk all of it, on the loop, between
  two steps.
"""
from __future__ import annotations

import gc
import os
import queue
import signal
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import zmq

from engine.guided.compile_pool import CompileBusy
from engine.requests import _hostpath
from engine.server.metrics import engine_stats
from engine.server.processes import ipc

if TYPE_CHECKING:
    from engine.config import EngineConfig


def _new_frame() -> ipc.Outputs:
    return ipc.Outputs([])


def die_with_parent() -> None:
    """Linux: the kernel kills this process when the one that started it exits, however it exits."""
    import ctypes
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)      # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:          # the parent was gone before the call took effect
        os._exit(1)


def freeze_heap() -> int:
    """Collect once, then move every object alive to the permanent generation (gc.freeze), which no collection
    walks; returns how many. Objects made later are collected as usual."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def main(config: EngineConfig, max_queued: int, addresses: ipc.Addresses, clients: int, ready, alive,
         index: int = 0) -> None:
    """Process entry. `config` is the engine's whole configuration, as the supervisor parsed it; `max_queued` is
    how many requests may wait beyond its rows. `ready` gets ("ready", ModelInfo) or ("error", message); `alive`
    is the write end of a pipe that only this process holds: API processes see EOF on it once this process is
    gone. `index`: which of the server's engine processes this is (its inbox)."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)       # the supervisor decides when to stop (SIGTERM)
    try:
        from engine.llm_engine import LLMEngine
        engine = LLMEngine(config)
        engine.guided.ensure_service()
        server = EngineServer(engine, addresses, clients, engine.config.max_num_seqs + max_queued, index)
    except Exception as exc:
        ready.send(("error", f"{type(exc).__name__}: {exc}" if not isinstance(exc, ValueError) else str(exc)))
        raise SystemExit(2)
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    freeze_heap()
    ready.send(("ready", ipc.model_info(engine)))
    ready.close()
    try:
        server.run()
    finally:
        engine.close()
        alive.close()
        gc.unfreeze()       # frozen objects outlive the interpreter's teardown, and nanobind reports each as a leak
    raise SystemExit(1 if server.error else 0)


class EngineServer:
    def __init__(self, engine, addresses: ipc.Addresses, clients: int, capacity: int, index: int = 0,
                 idle_wait_ms: int = 50):
        self.engine, self.capacity, self.index, self.idle_wait_ms = engine, capacity, index, idle_wait_ms
        self.context = zmq.Context()
        self.inbox = self.context.socket(zmq.PULL)
        self.inbox.bind(addresses.inbox(index))
        self.outboxes = []
        for client in range(clients):
            sock = self.context.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)          # never block the loop on a slow API process
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(addresses.outbox(client))
            self.outboxes.append(sock)
        self.decode = ipc.engine_decoder().decode
        # request id -> (client, sub, choice, text, whole): `text`, the engine sends its text (stop strings);
        # `whole`, every output goes as an ipc.Out (text or logprobs ride along), else all but the last as columns
        self.routes: dict[int, tuple[int, int, int, bool, bool]] = {}
        self.subs: dict[tuple[int, int], set[int]] = {}            # (client, sub) -> its unfinished request ids
        self.compiles: dict[tuple[int, int], object] = {}          # (client, token) -> GuidedRequest
        self._replies: queue.SimpleQueue = queue.SimpleQueue()     # ((client, token), frame) from compile threads
        self._checker = ThreadPoolExecutor(2, thread_name_prefix="specdec-compile-check")
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.poller = zmq.Poller()
        self.poller.register(self.inbox, zmq.POLLIN)
        self.poller.register(self._wake_r, zmq.POLLIN)
        self.running, self.error = True, None
        self.io_seconds = 0.0       # the loop's time in _drain and _publish around busy steps (metrics)

    def stop(self) -> None:
        self.running = False

    # ---- the loop --------------------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            while self.running:
                start = time.perf_counter()
                self._drain()
                drained = time.perf_counter() - start
                if self.engine.has_unfinished():
                    outputs = self.engine.step()
                    start = time.perf_counter()
                    self._publish(outputs)
                    self.io_seconds += drained + time.perf_counter() - start
                else:
                    self._idle()
        except Exception as exc:          # a bug or a lost tensor-parallel worker, not a bad request
            self.error = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            self._broadcast(ipc.Fatal(self.error, self.index))
        finally:
            for rid in list(self.routes):
                self.engine.abort(rid)
            self._checker.shutdown(wait=False, cancel_futures=True)
            for sock in (self.inbox, *self.outboxes):
                sock.close()
            self.context.term()

    def _idle(self) -> None:
        events = dict(self.poller.poll(self.idle_wait_ms))
        if self._wake_r in events:
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass

    def _drain(self) -> None:
        while True:
            try:
                frame = self.inbox.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            self._handle(self.decode(frame))
        while True:
            try:
                key, frame = self._replies.get_nowait()
            except queue.Empty:
                return
            self.compiles.pop(key, None)
            self.outboxes[key[0]].send(frame)

    def _handle(self, msg) -> None:
        if isinstance(msg, ipc.Add):
            self._add(msg)
        elif isinstance(msg, ipc.Abort):
            for rid in self.subs.get((msg.client, msg.sub), ()):
                self.engine.abort(rid)
        elif isinstance(msg, ipc.Compile):
            self._compile(msg)
        elif isinstance(msg, ipc.CancelCompile):
            pending = self.compiles.pop((msg.client, msg.token), None)
            if pending is not None:
                pending.cancel()
        elif isinstance(msg, ipc.Stats):
            stats = engine_stats(self.engine, len(self.routes), True, self.io_seconds)
            self.outboxes[msg.client].send(ipc.encode(ipc.StatsReply(msg.token, stats)))
        elif isinstance(msg, ipc.ResetCache):
            reply = ipc.StatsReply(msg.token, {"reset_pages": self.engine.reset_prefix_cache()})
            self.outboxes[msg.client].send(ipc.encode(reply))

    def _add(self, msg: ipc.Add) -> None:
        out = self.outboxes[msg.client]
        if len(self.routes) + len(msg.params) > self.capacity:
            out.send(ipc.encode(ipc.Added(msg.sub, "overloaded", f"the server is at capacity ({len(self.routes)} "
                                          f"requests in progress, at most {self.capacity}); retry later")))
            return
        ids = []
        try:
            for choice, fields in enumerate(msg.params):
                params = ipc.params_from_wire(fields)
                text = bool(params.stop)              # stop strings: the engine reads (and sends) the text
                ids.append(self.engine.add_request(msg.prompt, params, stream=text, detokenize=text))
                self.routes[ids[-1]] = (msg.client, msg.sub, choice, text, text or params.logprobs is not None)
        except Exception as err:                      # all or none: undo the choices already added
            for rid in ids:
                self.engine.abort(rid)
                self.routes.pop(rid, None)
            message = str(err) if isinstance(err, ValueError) else f"{type(err).__name__}: {err}"
            out.send(ipc.encode(ipc.Added(msg.sub, "invalid", message)))
            return
        self.subs[(msg.client, msg.sub)] = set(ids)
        out.send(ipc.encode(ipc.Added(msg.sub)))

    def _publish(self, outputs) -> None:
        """Each API process's outputs of a step in one frame: the rows that bring only token ids (most of them)
        into its columns in native code, the rest as `Out`s (_publish_out)."""
        frames: dict[int, ipc.Outputs] = {}
        for o in _hostpath.publish_columns(outputs, self.routes, frames, _new_frame):
            self._publish_out(frames, o)
        for client, frame in frames.items():
            self.outboxes[client].send(ipc.encode(frame))

    def _publish_out(self, frames: dict, o) -> None:
        """An output as an `Out` of its client's frame (one with text or logprobs, or a request's last); a final
        one ends the request's route. An output whose route is gone (an undone choice's abort, or ended by an
        output before it in the step) is dropped."""
        route = self.routes.get(o.request_id)
        if route is None:
            return
        client, sub, choice, text, _ = route
        frame = frames.get(client)
        if frame is None:
            frame = frames[client] = _new_frame()
        frame.items.append(ipc.Out(
            sub, choice, list(o.new_token_ids), o.new_text if text else None, o.finished, o.finish_reason,
            o.error, o.spec, o.logprobs, o.cached_tokens, o.prompt_logprobs, o.closed_by))
        if o.finished:
            del self.routes[o.request_id]
            left = self.subs.get((client, sub))
            if left is not None:
                left.discard(o.request_id)
                if not left:
                    del self.subs[(client, sub)]

    def _broadcast(self, msg) -> None:
        frame = ipc.encode(msg)
        for sock in self.outboxes:
            sock.send(frame)

    # ---- grammar compiles (admission) ------------------------------------------------------------------------
    def _compile(self, msg: ipc.Compile) -> None:
        try:
            pending = self.engine.guided.admit(ipc.guide_from_wire(msg.guide), msg.owner)
        except (ValueError, CompileBusy) as exc:
            code = "busy" if isinstance(exc, CompileBusy) else "invalid"
            self.outboxes[msg.client].send(ipc.encode(ipc.Compiled(msg.token, code, str(exc))))
            return
        key = (msg.client, msg.token)
        self.compiles[key] = pending
        pending.future.add_done_callback(lambda _: self._checker.submit(self._check, key, pending))

    def _check(self, key: tuple[int, int], pending) -> None:
        """A compile thread: whether the compiled grammar can start (tracker.check_compiled), as a reply."""
        try:
            minimum = self.engine.guided.check_compiled(pending)
            reply = ipc.Compiled(key[1], "ok", minimum=minimum or 0)
        except ValueError as exc:
            reply = ipc.Compiled(key[1], "invalid", str(exc))
        except Exception as exc:              # cancelled while queued: nobody waits for it
            reply = ipc.Compiled(key[1], "invalid", f"{type(exc).__name__}: {exc}")
        self._replies.put((key, ipc.encode(reply)))
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:               # the pipe is full: the loop has a wake-up pending already
            pass
