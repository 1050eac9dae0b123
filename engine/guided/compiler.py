"""Grammar compilation off the loop thread, and the per-request grammar state.

`GrammarService.submit(guide)` returns a `GuidedRequest` at once: from the service's cache of compiled grammars
(a repeated schema never queues), or compiling on a small thread pool. The request may prefill meanwhile; the
scheduler lets it sample only once `ready` (its matcher exists). A compile error fails the request alone with
a message naming the guide.

One client cannot fill the pool: compiles not yet finished are bounded in all and per owner (the server passes
its client), past which `submit` raises CompileBusy (engine/guided/compile_pool.py). xgrammar cannot stop a compile
once it runs, and its threads take whole cores: with `processes` (`specdec serve`'s default) each xgrammar compile
runs in a child of the compile process (engine/guided/compile_procs.py) at low CPU priority on a quarter of the
CPUs, and comes back serialised. When the last request for a grammar gives up (its time budget, an abort), its
compile is cancelled if queued and killed if running, so an abandoned compile holds no thread, core or memory.
Without `processes` a running compile finishes into the cache. llguidance builds its grammars lazily (a lexer per
state as reached), in milliseconds, so its compiles stay on the pool's threads. The cache is bounded in bytes
(`cache_bytes`).

Tokenizer info: xgrammar's `from_huggingface` detects special tokens by their decoded text, which our
GGUF-converted tokenizer does not give it, so `<|im_start|>` and friends would be allowed inside JSON strings.
`tokenizer_info` builds the info from the vocabulary itself, blanking every special added token (xgrammar
treats an empty token as special: never inside text) and naming the model's EOS ids as the stop tokens that
end a completed grammar.
"""
from __future__ import annotations

import collections
import functools
import json
import re
import threading
import time
import weakref
from concurrent.futures import Future
from operator import attrgetter

import xgrammar as xgr

from engine.guided import llg, native
from engine.guided.compile_pool import CompilePool
from engine.guided.compile_procs import CompileAbandoned, CompileCrashed, CompileProcesses
from engine.guided.compile_worker import compile_guide
from engine.guided.guide import Guide

_XGR_PREFIX = re.compile(r"\[[\d:]+\] \S+:\d+: ")      # xgrammar's "[time] file.cc:line: " before its message
CACHE_BYTES = 512 << 20     # compiled grammars kept by the service (xgrammar's memory_size_bytes)
__all__ = ["compile_guide", "GrammarService", "GuidedRequest"]


def compile_error(guide: Guide, exc: BaseException) -> str:
    """The message a request gets when its guide does not compile. xgrammar's internal assertions ("Check
    failed: ...") are its own limits, not the user's mistake: a schema that is valid JSON Schema gets a message
    saying so and naming the backend, not the assertion text."""
    text = _XGR_PREFIX.sub("", str(exc)).strip()
    if isinstance(exc, (CompileAbandoned, CompileCrashed)):
        return f"compiling the {guide.kind} failed: {text}"
    if guide.backend == "llguidance":
        return f"invalid {guide.kind} for the llguidance backend: {text}"
    if "Check failed" not in text:
        return f"invalid {guide.kind}: {text}"
    invalid = _schema_problem(guide) if guide.kind == "json_schema" else None
    if invalid:
        return f"invalid json_schema: {invalid}"
    return (f"{guide.kind} is valid but the grammar backend (xgrammar) could not compile it: a construct it does "
            "not support (e.g. a long fixed repetition in a pattern)")


def _schema_problem(guide: Guide) -> str | None:
    try:
        import jsonschema
    except ImportError:
        return None
    schema = json.loads(guide.source)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        return exc.message[:300]
    return None


def tokenizer_info(tokenizer, vocab_size: int, eos_ids) -> xgr.TokenizerInfo:
    """Immutable, and slow to build: the engines of a process that share a tokenizer share it too."""
    return _tokenizer_info(tokenizer, vocab_size, tuple(sorted(eos_ids)))


@functools.lru_cache(maxsize=4)
def _tokenizer_info(tokenizer, vocab_size: int, eos_ids: tuple) -> xgr.TokenizerInfo:
    hf = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_ids))
    vocab = [""] * vocab_size
    for text, i in tokenizer.get_vocab().items():
        if i < vocab_size:
            vocab[i] = text
    for i, added in tokenizer.added_tokens_decoder.items():
        if added.special and i < vocab_size:
            vocab[i] = ""
    return xgr.TokenizerInfo(vocab, hf.vocab_type, vocab_size=vocab_size, stop_token_ids=list(eos_ids),
                             add_prefix_space=hf.add_prefix_space)


class GuidedRequest:
    """One request's grammar: compile future, then its matcher. The matcher is touched only by the grammar
    callbacks (one grammar stream, in order) once the request has sampled. So are `accepted` (output tokens
    the matcher has accepted: a snapshot's host-known tokens are fed from there, so recompute after preemption
    never feeds a token twice) and `through_step` (the last step whose device-sampled tokens it accepted: the
    draft callbacks of a step and the next step's mask callback both may, the first to run does). The loop
    thread only reads `accepted`, as a lower bound. `error` is set by a callback and read at the commit of
    that step (which comes after it). The three live in native memory (`state`), where the grammar node reads
    and writes them without the GIL."""

    def __init__(self, guide: Guide, future: Future, release=None):
        self.guide = guide
        self.future = future        # the compile's, shared by the requests for one guide: cancel() through here
        self.started = time.monotonic()
        self._release = release
        self.state = native.RowState()
        self.handle = 0             # the matcher's tvm-ffi handle (0: none, or not xgrammar's own matcher)
        self.llg = None             # the native llguidance matcher (None: none, or not llguidance's)
        self._matcher: xgr.GrammarMatcher | None = None
        self.ready = False          # it has its matcher (a plain attribute: the scheduler's native walk reads it)
        self._entry = None          # (registry, index): its entry in a grammar node's registry (`entry`)
        self.guide_ids = ()         # its guide's text as token ids, where a draft head may draft them

    @property
    def matcher(self):
        return self._matcher

    @matcher.setter
    def matcher(self, matcher) -> None:
        self._matcher, self.handle, self.llg = matcher, native.handle(matcher), native.llg_matcher(matcher)
        self.ready = matcher is not None
        if self._entry is not None:
            self._entry[0].set_matcher(self._entry[1], self.handle, self.llg)

    def entry(self, registry) -> int:
        """Its index in a grammar node's registry (engine/guided/csrc/registry.h), which snapshots name it by:
        registered on first use, removed when this request is collected."""
        if self._entry is not None and self._entry[0] is registry:
            return self._entry[1]
        index = registry.add(self.state)
        registry.set_matcher(index, self.handle, self.llg)
        weakref.finalize(self, registry.remove, index)
        self._entry = (registry, index)
        return index

    # C getters (no Python frame): the native commit and schedule walks read these for every guided row
    accepted = property(attrgetter("state.accepted"), lambda self, v: setattr(self.state, "accepted", v))
    through_step = property(attrgetter("state.through_step"), lambda self, v: setattr(self.state, "through_step", v))
    error = property(attrgetter("state.error"), lambda self, v: setattr(self.state, "error", v))

    def cancel(self) -> None:
        """This request no longer waits for its grammar (it ended, or its time ran out). Idempotent."""
        release, self._release = self._release, None
        if release is not None and not self.future.done():
            release()

    def poll(self) -> str | None:
        """Loop thread: make the matcher once compiled. Returns an error message if compiling failed."""
        if self.matcher is not None or not self.future.done():
            return None
        if self.future.cancelled():
            return f"compiling the {self.guide.kind} was cancelled"
        exc = self.future.exception()
        if exc is not None:
            return compile_error(self.guide, exc)
        self.matcher = new_matcher(self.future.result())
        return None


def new_matcher(compiled):
    """A matcher at the start of a compiled grammar of either backend."""
    if isinstance(compiled, xgr.CompiledGrammar):
        return xgr.GrammarMatcher(compiled)
    return compiled.matcher()


class _Compile:
    """One grammar's compile under way: its future, the requests waiting on it, and its job (None: a thread)."""

    def __init__(self, job):
        self.job, self.waiting, self.future = job, 0, None


class GrammarService:
    def __init__(self, tokenizer, vocab_size: int, eos_ids, threads: int = 4, queue: int = 64,
                 processes: bool = False, cache_bytes: int = CACHE_BYTES):
        self.vocab_size, self._hf, self._eos = vocab_size, tokenizer, sorted(eos_ids)
        self._llg_tokenizer = None          # llguidance's (not cheap), built by the first compile that needs it
        self.info = tokenizer_info(tokenizer, vocab_size, eos_ids)
        # the service caches compiled grammars and shares compiles itself: xgrammar's own cache would hold a
        # second reference to each, and keep them past the service's bound
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.procs = CompileProcesses(self.info, threads) if processes else None
        self.pool = CompilePool(threads, queue)
        self.cache_bytes = cache_bytes
        self._lock = threading.Lock()       # guards the cache and the in-flight table (any thread)
        self._llg_lock = threading.Lock()   # guards building llguidance's tokenizer
        self._cache: collections.OrderedDict[Guide, xgr.CompiledGrammar] = collections.OrderedDict()
        self._cache_bytes = 0
        self._inflight: dict[Guide, _Compile] = {}

    def submit(self, guide: Guide, owner=None) -> GuidedRequest:
        """A request for `guide`'s grammar: done at once when cached, sharing the compile when one is under
        way. With an owner (a server's client) the pool's bounds apply (CompileBusy); the engine's own submits
        (owner None) are never refused: a server admitted them already."""
        with self._lock:
            compiled = self._cache.get(guide)
            if compiled is not None:
                self._cache.move_to_end(guide)
                future: Future = Future()
                future.set_result(compiled)
                return GuidedRequest(guide, future)
            entry = self._inflight.get(guide)
            if entry is None:
                isolated = self.procs is not None and guide.backend != "llguidance"
                entry = _Compile(self.procs.job() if isolated else None)
                entry.future = self.pool.submit(lambda: self._compile(guide, entry), owner, bounded=owner is not None)
                self._inflight[guide] = entry
            entry.waiting += 1
        return GuidedRequest(guide, entry.future, lambda: self._release(guide, entry))

    def _release(self, guide: Guide, entry: _Compile) -> None:
        """A request gave up on its compile: the last one to do so cancels it while queued, or kills it while it
        runs in a process. A later request for the guide starts a compile of its own."""
        with self._lock:
            entry.waiting -= 1
            if entry.waiting or self._inflight.get(guide) is not entry:
                return
            if entry.future.cancel():
                del self._inflight[guide]
            elif entry.job is not None:
                del self._inflight[guide]
                entry.job.kill()

    def llg_tokenizer(self):
        with self._llg_lock:    # compile threads: one builds it, the others wait for it
            if self._llg_tokenizer is None:
                self._llg_tokenizer = llg.tokenizer(self._hf, self.info, self._eos)
            return self._llg_tokenizer

    def _build(self, guide: Guide, job=None):
        if guide.backend == "llguidance":
            return llg.LLGrammar(self.llg_tokenizer(), llg.guide_grammar(guide))
        if job is not None:
            return self.procs.run(job, guide)
        return compile_guide(self.compiler, guide)

    def _compile(self, guide: Guide, entry: _Compile):
        try:
            compiled = self._build(guide, entry.job)
        except BaseException:
            with self._lock:
                if self._inflight.get(guide) is entry:
                    del self._inflight[guide]
            raise
        with self._lock:        # leaves in-flight and enters the cache at once: no submit finds it in neither
            if self._inflight.get(guide) is entry:
                del self._inflight[guide]
            if guide not in self._cache:
                self._cache[guide] = compiled
                self._cache_bytes += compiled.memory_size_bytes
            while self._cache_bytes > self.cache_bytes and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self._cache_bytes -= old.memory_size_bytes
        return compiled

    def compile_clock_start(self, started: float) -> float | None:
        """When a compile submitted at `started` (time.monotonic()) began to count against its budget: not before
        the compile process could take it (its interpreter's start is no grammar's cost); None while it starts."""
        if self.procs is None:
            return started
        ready = self.procs.ready_since
        return None if ready is None else max(started, ready)

    def compiling(self) -> int:
        """Compiles submitted and not finished (queued or running, abandoned ones included)."""
        return self.pool.unfinished()

    def compile_now(self, guide: Guide):
        """Compile on this thread (tests); raises what the backend raises."""
        return self._build(guide)

    def close(self) -> None:
        self.pool.close()
        if self.procs is not None:
            self.procs.close()
