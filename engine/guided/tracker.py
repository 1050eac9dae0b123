"""The engine's side of guided decoding: requests whose grammar compiles, the step snapshots, and the
failures a step's commit must report (engine/llm_engine.py calls it; the callbacks never do)."""
from __future__ import annotations

import concurrent.futures
import time

import torch
import xgrammar as xgr

import hostfunc
from engine.guided import limits
from engine.guided.closing import JSON_KINDS, UNKNOWN, Closer
from engine.guided.closing_search import ClosingVocab
from engine.guided.compiler import GrammarService, GuidedRequest, new_matcher, tokenizer_info
from engine.guided.snapshot import Snapshot

CACHED_COMPILE_WAIT = 0.002     # seconds add_request waits for a compile before leaving it to the pool
INITIAL_CACHE = 1024          # guides a tracker remembers a fact of (checked, first closing, ids, compile check)


def remember(cache: dict, key, value):
    """cache[key] = value, the cache emptied first once it holds INITIAL_CACHE guides; returns value."""
    if len(cache) >= INITIAL_CACHE:
        cache.clear()
    cache[key] = value
    return value


class GuidedTracker:
    def __init__(self, tokenizer, vocab_size: int, eos_ids, config, cuda: bool, lend_ids: bool = False):
        self.tokenizer = tokenizer
        self._make = lambda: GrammarService(tokenizer, vocab_size, eos_ids, config.grammar_compile_threads,
                                            config.grammar_compile_queue, config.grammar_compile_processes,
                                            config.grammar_cache_mb << 20)
        self._info = lambda: tokenizer_info(tokenizer, vocab_size, eos_ids)     # the service's own (one per process)
        self.service: GrammarService | None = None      # built on the first guided request (not cheap)
        self.enabled, self.cuda, self.has_tokenizer = config.guided, cuda, tokenizer is not None
        self.timeout_s = config.grammar_compile_timeout_s
        t = config.tuning
        self.bounds = (t.guide_max_bytes, t.guide_max_enum, t.guide_max_depth, t.guide_max_repeat)
        self.compiling: list = []                       # sequences whose grammar is not ready yet
        self.repeat_limit = t.guided_repeat_limit
        self.spec_k = config.num_speculative_tokens if config.speculative != "none" else 0
        self._vocab: ClosingVocab | None = None         # built with the service, or when first asked for
        self._initial: dict = {}                        # guide -> its closing from the start (see closer)
        self._checked: dict = {}                        # guides within self.bounds (a guide's check is the same
                                                        # for every request of it, and walks its whole schema)
        self._minimum: dict = {}                        # guide -> check_compiled's answer (compile-check threads)
        # lend_ids: a head's drafts can be what the guide's text holds (property names, enum values): its token ids
        # go to the draft vocabulary's spare rows (engine/speculative/prompt_vocab.py), tokenized once a guide
        self.lend_ids = lend_ids
        self._guide_ids: dict = {}

    def start(self, seq) -> None:
        """At add_request: start compiling (raises ValueError if guided decoding cannot run here)."""
        if not self.enabled:
            raise ValueError("this engine was built with guided=False: guides are not available")
        if not self.has_tokenizer:
            raise ValueError("guided decoding needs the model's tokenizer, and this model has none")
        self.check_guide(seq.params.guide)
        if self.service is None:
            self._start_service()
        seq.guided = self.service.submit(seq.params.guide)
        if self.lend_ids:
            seq.guided.guide_ids = self.guide_ids(seq.params.guide)
        # A cached grammar is ready almost at once: waiting for it lets the request sample in its first step
        # (a later poll would find it ready one step late); an uncached one goes on in the background.
        if not seq.guided.future.done():
            concurrent.futures.wait([seq.guided.future], timeout=CACHED_COMPILE_WAIT)
        seq.guided.poll()
        self.compiling.append(seq)

    def check_guide(self, guide) -> None:
        """Raise ValueError if `guide` passes one of this engine's bounds (limits.check_guide); a guide that passed
        is remembered, not walked again."""
        if guide in self._checked:
            return
        limits.check_guide(guide, *self.bounds)
        remember(self._checked, guide, None)

    def guide_ids(self, guide) -> list[int]:
        """The token ids of the guide's source text (its JSON schema, regex or grammar), remembered a guide."""
        ids = self._guide_ids.get(guide)
        if ids is None:
            ids = remember(self._guide_ids, guide, self.tokenizer.encode(guide.source, add_special_tokens=False))
        return ids

    def ensure_service(self) -> None:
        """Build the compiler now (before another thread may call `check`)."""
        if self.enabled and self.has_tokenizer and self.service is None:
            self._start_service()

    def _start_service(self) -> None:
        self.service = self._make()
        _ = self.vocab      # (not cheap either: built with the service, not on a request's path)

    def admit(self, guide, owner) -> GuidedRequest:
        """Server, before queueing a request: check `guide`'s bounds and start compiling it for `owner` (a
        client). Raises ValueError (a bound) or CompileBusy (the pool's or this owner's share is full)."""
        if self.service is None:
            raise ValueError("guided decoding is not available on this engine")
        self.check_guide(guide)
        return self.service.submit(guide, owner)

    def check_compiled(self, request: GuidedRequest) -> int | None:
        """After `admit`'s compile is done: raise ValueError naming the problem if it failed, or if its first
        mask allows no token; else the guide's shortest whole output in tokens (None: not known). The request's
        own compile then hits the cache. (A grammar that dead-ends later is caught only when a step's mask
        allows nothing.)"""
        message = request.poll()
        if message is not None:
            raise ValueError(message)
        if request.guide in self._minimum:      # the same grammar gives the same answer: asked once a guide
            return self._minimum[request.guide]
        mask = xgr.allocate_token_bitmask(1, self.service.vocab_size)
        new_matcher(request.future.result()).fill_next_token_bitmask(mask, 0)
        if not torch.any(mask != 0):
            raise ValueError(f"{request.guide.kind} allows no output at all (unsatisfiable)")
        closer = self.closer(request.future.result(), None, request.guide)
        return remember(self._minimum, request.guide, closer.minimum if closer is not None else None)

    def timeout_message(self, guide) -> str:
        return limits.timeout_message(guide, self.timeout_s)

    def poll(self) -> list[tuple]:
        """Loop thread, before planning: (seq, message) for each grammar that failed to compile."""
        failed, still = [], []
        now = time.monotonic()
        for seq in self.compiling:
            if seq.finalized:
                seq.guided.cancel()          # aborted while compiling: a queued compile never runs
                continue
            message = seq.guided.poll()
            begun = self.service.compile_clock_start(seq.guided.started)
            if message is None and not seq.guided.ready and begun is not None and now - begun > self.timeout_s:
                seq.guided.cancel()
                message = self.timeout_message(seq.guided.guide)
            if message is None and seq.guided.ready:
                message = self._start_closing(seq)
            if message is not None:
                failed.append((seq, message))
            elif not seq.guided.ready:
                still.append(seq)
        self.compiling = still
        return failed

    def closer(self, compiled, params, guide=None) -> Closer | None:
        """A Closer for a request's compiled grammar (None: xgrammar runs neither of its features for it);
        params None: both on (to read its `minimum`). Its first closing is the same for every request of a guide:
        found once (any thread: a dict's get and set are atomic)."""
        budget = params is None or params.close_at_budget
        guard = self.repeat_limit if params is None or (params.repetition_guard and params.guide.kind in JSON_KINDS) \
            else 0
        if not isinstance(compiled, xgr.CompiledGrammar) or not (budget or guard):
            return None
        guide = guide if guide is not None or params is None else params.guide
        initial = self._initial.get(guide, UNKNOWN) if guide is not None else UNKNOWN
        closer = Closer(compiled, self.vocab, budget, guard, self.spec_k, initial)
        if initial is UNKNOWN and guide is not None:
            remember(self._initial, guide, closer.text)
        return closer

    @property
    def vocab(self) -> ClosingVocab:
        """The closers' view of the vocabulary: built once, by whichever thread asks first (the same either way)."""
        if self._vocab is None:
            self._vocab = ClosingVocab(self._info())
        return self._vocab

    def _start_closing(self, seq) -> str | None:
        """Its grammar is ready: its Closer, or why its max_tokens can hold no valid output."""
        try:
            seq.closer = self.closer(seq.guided.future.result(), seq.params)
        except Exception as exc:            # noqa: BLE001 - this request alone fails
            return f"guided decoding failed: {type(exc).__name__}: {exc}"
        if seq.closer is None or not seq.params.close_at_budget:
            return None
        return limits.budget_problem(seq.closer.minimum, seq.max_len - len(seq.prompt_token_ids), seq.params.guide)

    def wait_for_compile(self, timeout: float) -> None:
        """Nothing can run until a grammar is ready: sleep on the compiles instead of spinning."""
        futures = [seq.guided.future for seq in self.compiling]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def step_failure(self, snapshot: Snapshot | None) -> str | None:
        """At a step's commit: a failure of its callback as a whole (every guided row of it fails)."""
        if snapshot is None:
            return None
        if snapshot.failure:
            return f"the grammar callback failed: {snapshot.failure}"
        if self.cuda:
            errors = hostfunc.take_errors(snapshot.owner)     # this engine's callbacks' (None: unpushed, any)
            if errors:
                return f"the grammar callback failed: {errors[0][1]}"
        return None

    @staticmethod
    def callback_times(snapshot: Snapshot | None, tokens_landed: float) -> tuple[float, float]:
        """(time inside the callback, delay from `tokens_landed` to its start), seconds."""
        if snapshot is None or snapshot.times is None:
            return 0.0, 0.0
        start, end = snapshot.times
        return end - start, max(0.0, start - tokens_landed)

    def close(self) -> None:
        if self.service is not None:
            self.service.close()
