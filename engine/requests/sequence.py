"""Requests as the scheduler sees them: sampling parameters and per-sequence state."""
from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass, field

from engine.guided.guide import GUIDE_FIELDS, Guide, make_guide
from engine.requests.stop_strings import MAX_STOP_CHARS, MAX_STOP_STRINGS
from engine.sampling.limits import MAX_LOGPROBS

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
MAX_TOKENS_LIMIT = 2 ** 31 - 1      # counters that reach the device are int64; keep far from overflow
MAX_LOGIT_BIAS = 1024               # tokens one request may bias (OpenAI allows 300)


def _integer(name: str, value, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    return int(value)


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def _sequence_of(name: str, value, kind: type) -> tuple:
    items = (value,) if isinstance(value, kind) else value
    if isinstance(items, (str, bytes)) or not isinstance(items, (list, tuple)):
        raise ValueError(f"{name} must be a {kind.__name__} or a list of them, got {value!r}")
    return tuple(items)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Validated on construction: a bad field raises ValueError naming it (never later, inside a step)."""
    max_tokens: int = 128
    temperature: float = 1.0          # 0 = greedy
    top_k: int = 0                    # 0 = off
    top_p: float = 1.0
    seed: int | None = None           # per-request seed: same seed, same tokens
    stop: tuple[str, ...] = ()        # stop strings (excluded from the output text)
    include_stop_str_in_output: bool = False    # a stop string that ends the request stays in its text
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Guided decoding, at most one (engine/guided/guide.py): the output matches it and ends when it completes.
    json_schema: dict | str | None = None
    json_object: bool = False         # any JSON object
    regex: str | None = None
    ebnf: str | None = None           # xgrammar EBNF (GBNF-like) grammar, root rule "root"
    choice: tuple[str, ...] | None = None
    structural_tag: dict | str | None = None   # xgrammar structural tag: free text with constrained regions
    any_whitespace: bool = False      # JSON guides: free whitespace between tokens (default: compact)
    # "auto": xgrammar, or llguidance for a JSON schema only it enforces; or name one (engine/guided/guide.py)
    guided_backend: str = "auto"
    num_speculative_tokens: int | None = None   # drafts per step: None = the engine's K, 0 = no speculation
    # Logprobs of each output token (engine/sampling/logprobs.py: log_softmax of the logits the token was chosen from,
    # after penalties, logit_bias and the grammar mask, before temperature / top-k / top-p): None = off, 0 = the
    # token's own only, 1..MAX_LOGPROBS = also that many of the most likely tokens.
    logprobs: int | None = None
    # vLLM's prompt_logprobs (engine/sampling/prompt_logprobs.py): None = off, else each prompt token's logprob and
    # rank, and that many of the most likely tokens at its place.
    prompt_logprobs: int | None = None
    # engine/sampling/penalties.py: OpenAI's presence / frequency penalties (over output tokens), vLLM's repetition
    # penalty (over prompt and output), min_p (after temperature / top-k / top-p), min_tokens (EOS and stop ids masked)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    # OpenAI's logit_bias: {token id: bias in [-100, 100], or -inf: never chosen (vLLM's bad_words)} added to the logits
    # after the penalties (stored as sorted (id, bias) pairs, hashable like every other field)
    logit_bias: dict | tuple | None = None
    # Guided outputs that end valid (engine/guided/closing.py, xgrammar guides): close the output before max_tokens
    # cuts it; close a JSON value that repeats one n-gram (the engine's guided_repeat_limit tokens)
    close_at_budget: bool = True
    repetition_guard: bool = True
    # derived in __post_init__ (slots: native code reads them at fixed offsets, engine/requests/csrc/slots.h)
    _guide: Guide | None = field(default=None, init=False, repr=False, compare=False)
    _penalty_row: bool = field(default=False, init=False, repr=False, compare=False)
    _penalized: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "max_tokens", _integer("max_tokens", self.max_tokens, 1, MAX_TOKENS_LIMIT))
        if _real("temperature", self.temperature) < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        object.__setattr__(self, "top_k", _integer("top_k", self.top_k, 0, MAX_TOKENS_LIMIT))
        if not 0.0 < _real("top_p", self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None:
            object.__setattr__(self, "seed", _integer("seed", self.seed, INT64_MIN, INT64_MAX))
        stop = _sequence_of("stop", self.stop, str)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must hold non-empty strings, got {list(stop)!r}"[:300])
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        longest = max(map(len, stop), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(f"stop: a stop string is at most {MAX_STOP_CHARS} characters, got {longest}")
        object.__setattr__(self, "stop", stop)
        ids = _sequence_of("stop_token_ids", self.stop_token_ids, numbers.Integral)
        object.__setattr__(self, "stop_token_ids", tuple(_integer("a stop token id", t, 0, INT64_MAX) for t in ids))
        for name in ("ignore_eos", "include_stop_str_in_output", "close_at_budget", "repetition_guard"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.num_speculative_tokens is not None:
            object.__setattr__(self, "num_speculative_tokens",
                               _integer("num_speculative_tokens", self.num_speculative_tokens, 0, 16))
        if self.logprobs is not None:
            object.__setattr__(self, "logprobs", _integer("logprobs", self.logprobs, 0, MAX_LOGPROBS))
        if self.prompt_logprobs is not None:
            object.__setattr__(self, "prompt_logprobs", _integer("prompt_logprobs", self.prompt_logprobs, 0,
                                                                 MAX_LOGPROBS))
        self._check_penalties()
        guide = make_guide({k: getattr(self, k) for k in GUIDE_FIELDS}, self.any_whitespace, self.guided_backend)
        if guide is not None and self.min_tokens:
            raise ValueError("min_tokens cannot be combined with a guide: the grammar decides where the output ends")
        if guide is not None and self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with a guide: a guided request ends when its grammar does")
        if guide is not None and guide.kind in ("json_schema", "structural_tag"):
            object.__setattr__(self, guide.kind, guide.source)     # hashable, like every other field
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        object.__setattr__(self, "_guide", guide)

    @property
    def guide(self) -> Guide | None:
        return self._guide

    @property
    def penalty_row(self) -> bool:
        """It holds a PenaltyState row (engine/sampling/penalties.py): a penalty reads its token counts, or it sets
        logit_bias."""
        return self._penalty_row

    @property
    def penalized(self) -> bool:
        """Its logits or its sampling change (penalties, min_p, min_tokens): it never speculates. Read for every
        row of every step, hence computed once."""
        return self._penalized

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= _real(name, getattr(self, name)) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < _real("repetition_penalty", self.repetition_penalty) <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if not 0.0 <= _real("min_p", self.min_p) <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        object.__setattr__(self, "min_tokens", _integer("min_tokens", self.min_tokens, 0, self.max_tokens))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        row = self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1 \
            or bool(self.logit_bias)
        object.__setattr__(self, "_penalty_row", row)
        object.__setattr__(self, "_penalized", row or self.min_p > 0 or self.min_tokens > 0)


def _logit_bias(value) -> tuple[tuple[int, float], ...] | None:
    """{id: bias} or (id, bias) pairs -> sorted pairs (None if empty); ids are checked against the vocabulary
    by the engine (engine/requests/validation.py)."""
    if value is None:
        return None
    if isinstance(value, dict):
        pairs = value.items()
    elif isinstance(value, (tuple, list)):
        pairs = value
    else:
        raise ValueError(f"logit_bias must map token ids to biases, got {type(value).__name__}")
    out = {}
    for item in pairs:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ValueError(f"logit_bias must map token ids to biases, got the entry {item!r}"[:200])
        token = _integer("a logit_bias token id", item[0], 0, INT64_MAX)
        bias = item[1]
        if not (isinstance(bias, float) and bias == -math.inf):       # -inf: a banned token
            bias = _real(f"logit_bias[{token}]", bias)
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias[{token}] must be in [-100, 100] (or -inf), got {bias}")
        out[token] = bias
    if len(out) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens, got {len(out)}")
    return tuple(sorted(out.items())) or None


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int                                   # resolved sampling seed
    arrival: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0                # tokens whose KV is in the cache
    block_table: list[int] = field(default_factory=list)
    block_digests: list = field(default_factory=list)   # prefix digests of its full pages of known tokens
    num_registered: int = 0                     # leading pages of block_table registered in the prefix cache
    num_cached_tokens: int = 0                  # prompt tokens its first admission found in the prefix cache
    finish_reason: str | None = None
    max_len: int = 0                            # prompt + max_tokens, capped by the context
    finalized: bool = False                     # stop seen and result emitted
    inflight_refs: int = 0                      # in-flight steps that still hold this row (0..2)
    num_pending: int = 0                        # sampled on the device, not yet committed (0 or 1; with
                                                # speculation up to 1 + K, counted as if every draft passed)
    pending_src: int = -1                       # its row in the in-flight step's `sampled` buffer
    text: str = ""                              # detokenized output, cut at a stop string (engine/requests/output.py)
    out: object = None                          # output state: incremental detokenizer, streamed text
    error: str | None = None                    # why the request failed (finish_reason "error")
    guided: object = None                       # GuidedRequest (engine/guided/compiler.py) of a guided request
    closer: object = None                       # its Closer (engine/guided/closing.py), once its grammar is ready
    retain: bool = False                        # keep it after it finishes, until LLMEngine.take()
    num_preemptions: int = 0
    pool_row: int = -1                          # its row of the device-side token pool (engine/memory/token_pool.py)
    spec: object = None                         # SpecStats of a request that speculated
    logprobs: list | None = None                # one engine.sampling.logprobs.Entry per output token (params.logprobs
                                                # set)
    prompt_logprobs: list | None = None         # engine/sampling/prompt_logprobs.py entries (params.prompt_logprobs)
    pen_row: int = -1                           # its row of the device-side penalty state (engine/sampling/
                                                # penalties.py)
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self):
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.max_len <= 0:
            self.max_len = len(self.prompt_token_ids) + self.params.max_tokens

    @property
    def num_tokens(self) -> int:
        """Tokens the host knows (prompt + committed outputs)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens the device knows: the host's plus the one still in flight."""
        return self.num_tokens + self.num_pending

    @property
    def grammar_blocked(self) -> bool:
        """Its grammar is not ready: a guided request samples nothing before its grammar compiled."""
        return self.guided is not None and not self.guided.ready

    @property
    def schedule_target(self) -> int:
        """Tokens it may compute now: all it knows, less the last one while its grammar is blocked (that
        token's step would sample)."""
        return self.num_scheduled_tokens - self.grammar_blocked

    @property
    def closed_by(self) -> str | None:
        """A guided output the engine closed: "budget" or "repetition" (engine/guided/closing.py), else None."""
        return self.closer.closed_by if self.closer is not None else None

    @property
    def capped(self) -> bool:
        """Its last token is already sampled (max_tokens or the context reached): schedule it no more."""
        return self.num_scheduled_tokens >= self.max_len

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def tokens(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]
