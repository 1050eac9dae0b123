"""Grammar compilation off the loop thread, and the per-request grammar state.

`GrammarService.submit(guide)` starts compiling on a small thread pool (xgrammar's compiler caches by
grammar, so a repeated schema costs a lookup) and returns a `GuidedRequest`. The request may prefill
meanwhile; the scheduler lets it sample only once `ready` (its matcher exists). A compile error fails the
request alone with a message naming the guide.

Tokenizer info: xgrammar's `from_huggingface` detects special tokens by their decoded text, which our
GGUF-converted tokenizer does not give it, so `<|im_start|>` and friends would be allowed inside JSON strings.
`tokenizer_info` builds the info from the vocabulary itself, blanking every special added token (xgrammar
treats an empty token as special: never inside text) and naming the model's EOS ids as the stop tokens that
end a completed grammar.
"""
from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar as xgr

from engine.guided import native
from engine.guided.spec import Guide


def tokenizer_info(tokenizer, vocab_size: int, eos_ids) -> xgr.TokenizerInfo:
    hf = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(eos_ids))
    vocab = [""] * vocab_size
    for text, i in tokenizer.get_vocab().items():
        if i < vocab_size:
            vocab[i] = text
    for i, added in tokenizer.added_tokens_decoder.items():
        if added.special and i < vocab_size:
            vocab[i] = ""
    return xgr.TokenizerInfo(vocab, hf.vocab_type, vocab_size=vocab_size, stop_token_ids=sorted(eos_ids),
                             add_prefix_space=hf.add_prefix_space)


def _choice_grammar(source: str) -> str:
    alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(source))
    return f"root ::= {alternatives}"


def compile_guide(compiler: xgr.GrammarCompiler, guide: Guide) -> xgr.CompiledGrammar:
    kind, src, ws = guide
    if kind in ("json_schema", "json_object"):
        return compiler.compile_json_schema(src, any_whitespace=ws, strict_mode=True)
    if kind == "regex":
        return compiler.compile_regex(src)
    if kind == "ebnf":
        return compiler.compile_grammar(src)
    if kind == "choice":
        return compiler.compile_grammar(_choice_grammar(src))
    if kind == "structural_tag":
        return compiler.compile_structural_tag(src)
    raise ValueError(f"unknown guide kind {kind!r}")


class GuidedRequest:
    """One request's grammar: compile future, then its matcher. The matcher is touched only by the grammar
    callbacks (one grammar stream, in order) once the request has sampled. So are `accepted` (output tokens
    the matcher has accepted: a snapshot's host-known tokens are fed from there, so recompute after preemption
    never feeds a token twice) and `through_step` (the last step whose device-sampled tokens it accepted: the
    draft callbacks of a step and the next step's mask callback both may, the first to run does). The loop
    thread only reads `accepted`, as a lower bound. `error` is set by a callback and read at the commit of
    that step (which comes after it). The three live in native memory (`state`), where the grammar node reads
    and writes them without the GIL."""

    def __init__(self, guide: Guide, future: Future):
        self.guide = guide
        self.future = future
        self.state = native.RowState()
        self.handle = 0             # the matcher's tvm-ffi handle (0: none, or not xgrammar's own matcher)
        self._matcher: xgr.GrammarMatcher | None = None

    @property
    def matcher(self):
        return self._matcher

    @matcher.setter
    def matcher(self, matcher) -> None:
        self._matcher, self.handle = matcher, native.handle(matcher)

    accepted = property(lambda self: self.state.accepted, lambda self, v: setattr(self.state, "accepted", v))
    through_step = property(lambda self: self.state.through_step,
                            lambda self, v: setattr(self.state, "through_step", v))
    error = property(lambda self: self.state.error, lambda self, v: setattr(self.state, "error", v))

    @property
    def ready(self) -> bool:
        return self.matcher is not None

    def poll(self) -> str | None:
        """Loop thread: make the matcher once compiled. Returns an error message if compiling failed."""
        if self.matcher is not None or not self.future.done():
            return None
        exc = self.future.exception()
        if exc is not None:
            return f"invalid {self.guide.kind}: {type(exc).__name__}: {exc}"
        self.matcher = xgr.GrammarMatcher(self.future.result())
        return None


class GrammarService:
    def __init__(self, tokenizer, vocab_size: int, eos_ids, threads: int = 2):
        self.vocab_size = vocab_size
        self.info = tokenizer_info(tokenizer, vocab_size, eos_ids)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=True)
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar-compile")

    def submit(self, guide: Guide) -> GuidedRequest:
        return GuidedRequest(guide, self.pool.submit(compile_guide, self.compiler, guide))

    def compile_now(self, guide: Guide) -> xgr.CompiledGrammar:
        """Compile on this thread (tests, validation before queueing); raises what xgrammar raises."""
        return compile_guide(self.compiler, guide)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
