"""Per-step timing counters of the decode loop (seconds), read by benchmarks."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

_PER_STEP = ("plan", "launch", "replay", "wait", "commit", "forward_gpu", "mask_wait_gpu", "sample_gpu", "gpu_idle",
             "callback", "callback_delay")


@dataclass
class StepTimings:
    steps: int = 0             # committed steps
    tokens: int = 0            # tokens sampled (zombie rows included)
    rows: int = 0
    zombie_rows: int = 0       # rows of finalized sequences that rode along in a step (pipelined)
    plan: float = 0.0          # CPU: schedule + fill host buffers
    launch: float = 0.0        # CPU: enqueue upload, forward, sampling, copy
    replay: float = 0.0        # CPU: of launch, the step graph's replay (0 for an eager step)
    wait: float = 0.0          # CPU blocked on a step's tokens
    commit: float = 0.0        # CPU: append tokens, stop checks, free pages
    forward_gpu: float = 0.0   # device time of the forward (CUDA events; 0 on CPU)
    mask_wait_gpu: float = 0.0  # compute stream waiting for the grammar mask after the forward
    sample_gpu: float = 0.0    # device time of sampling
    guided_steps: int = 0      # committed steps with guided rows (a grammar callback each)
    callback: float = 0.0      # host time inside grammar callbacks
    callback_delay: float = 0.0  # from the previous step's tokens landing on the host to the callback's start
    gpu_idle: float = 0.0      # compute stream idle between the end of a step and the start of the next
    wall: float = 0.0          # time spent inside LLMEngine.step()
    spec_rows: int = 0         # speculation: rows that verified drafts (one per request per spec step)
    spec_proposed: int = 0     # drafts those rows verified
    spec_accepted: int = 0     # drafts accepted
    spec_leaves: int = 0       # draft trees: rows whose last accepted draft was a leaf (engine/speculative/tree.py)
    spec_levels: dict = field(default_factory=dict)  # verifying rows by their step's level: {drafts a row holds
                                                     # (K, or a tree's): rows}, what the draft budget chose
    quiet_steps: int = 0       # speculation: launched steps that drafted nothing (a paused engine's plain steps)
    prefix_query_tokens: int = 0   # prompt tokens of admitted requests looked up in the prefix cache
    prefix_hit_tokens: int = 0     # ... of them found there (mapped, not computed)
    trace: list | None = field(default=None, repr=False)  # set to [] to keep one dict per committed step

    def add(self, **kw) -> None:
        for k, v in kw.items():
            setattr(self, k, getattr(self, k) + v)

    def add_step(self, extra: dict | None = None, **kw) -> None:
        """Count one committed step; `extra` (e.g. its period) goes only into the trace."""
        self.steps += 1
        self.add(**kw)
        if self.trace is not None:
            self.trace.append(kw | (extra or {}))

    def reset(self, trace: bool = False) -> None:
        for f in fields(self):
            if f.name != "trace":
                setattr(self, f.name, type(getattr(self, f.name))())
        self.trace = [] if trace else None

    @property
    def acceptance_length(self) -> float:
        """Tokens per verifying row-step, the target's own token included (0: nothing speculated)."""
        return (self.spec_accepted + self.spec_rows) / self.spec_rows if self.spec_rows else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    def per_step_ms(self) -> dict[str, float]:
        n = max(self.steps, 1)
        out = {k: 1e3 * getattr(self, k) / n for k in _PER_STEP}
        out["period"] = 1e3 * self.wall / n
        return out
