"""Per-step timing counters of the decode loop (seconds), read by benchmarks."""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class StepTimings:
    steps: int = 0
    tokens: int = 0
    rows: int = 0
    plan: float = 0.0          # CPU: schedule + fill host buffers
    launch: float = 0.0        # CPU: enqueue upload, forward, sampling, copy
    wait: float = 0.0          # CPU blocked on the step's tokens
    commit: float = 0.0        # CPU: append tokens, stop checks, free pages
    forward_gpu: float = 0.0   # device time of the forward (CUDA events; 0 on CPU)
    sample_gpu: float = 0.0    # device time of sampling

    def add(self, **kw) -> None:
        self.steps += 1
        for k, v in kw.items():
            setattr(self, k, getattr(self, k) + v)

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, type(getattr(self, f.name))())

    def per_step_ms(self) -> dict[str, float]:
        n = max(self.steps, 1)
        keys = ("plan", "launch", "wait", "commit", "forward_gpu", "sample_gpu")
        return {k: 1e3 * getattr(self, k) / n for k in keys}
