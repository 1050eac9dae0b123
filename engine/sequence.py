"""Requests as the scheduler sees them: sampling parameters and per-sequence state."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 1.0          # 0 = greedy
    top_k: int = 0                    # 0 = off
    top_p: float = 1.0
    seed: int | None = None           # per-request seed: same seed, same tokens
    stop: tuple[str, ...] = ()        # stop strings (excluded from the output text)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
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
    finish_reason: str | None = None
    max_len: int = 0                            # prompt + max_tokens, capped by the context
    finalized: bool = False                     # stop seen and result emitted
    inflight_refs: int = 0                      # in-flight steps that still hold this row (0..2)
    num_pending: int = 0                        # sampled on the device, not yet committed (0 or 1)
    pending_src: int = -1                       # its row in the in-flight step's `sampled` buffer
    text: str = ""                              # detokenized output (maintained by the engine)
    num_preemptions: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self):
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
