"""Device-side speculation state: the token pool's rows (engine/memory/token_pool.py: last token, drafts) and what
only speculation needs besides, and per-request statistics.

A step learns how many drafts were accepted only on the device, and the host plans the next step before it
knows (the pipelined loop). So what the next step needs lives here, indexed by the sequence's `pool_row`,
written by the step that produced it and read by the next step of the same sequence on the same compute
stream:
- `history[row, :]`: the sequence's tokens by position (what the n-gram drafter searches). A step scatters
  its input tokens (prompt chunks included) and its emitted tokens into it.
- `rejected[row]`: drafts of the last step that were not accepted. The host planned the next step as if all
  were; the device moves that step's positions, seq_lens, slot mapping and sampling index back by this much.
- the pool's `drafts[row, :K]`, `draft_count[row]`: the drafter's guesses for the next step, made at the end
  of this one (so an EAGLE head can use this step's hidden states); `last_token[row]`: the bonus token.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.memory.token_pool import TokenPool
from engine.sampling.penalties import to_device


class SpecState(TokenPool):
    def __init__(self, num_rows: int, max_model_len: int, k: int, device: torch.device):
        super().__init__(num_rows, k, device)
        self.max_model_len = max_model_len
        rows = num_rows + 1
        # column max_model_len is a dummy too: emitted-token writes past a row's count land there
        self.history = torch.zeros(rows, max_model_len + 1, dtype=torch.int32, device=device)
        self.rejected = torch.zeros(rows, dtype=torch.int64, device=device)

    def write_history(self, writes: list) -> None:
        """[(row, tokens)]: each row's history from position 0, on the current stream (the compute stream, in
        step order): the prefix a sequence found in the prefix cache, which no step of its own computes."""
        for row, tokens in writes:
            self.history[row, :len(tokens)] = to_device(torch.tensor(tokens, dtype=torch.int32), self.history.device)


@dataclass
class SpecStats:
    """Speculation counters of one request: steps that verified drafts, drafts proposed and accepted, and
    acceptances by draft position (position i accepted => all before it were)."""
    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    by_position: list[int] = field(default_factory=list)        # accepted at draft position i
    proposed_by_position: list[int] = field(default_factory=list)

    def add(self, proposed: int, accepted: int) -> None:
        self.steps += 1
        self.proposed += proposed
        self.accepted += accepted
        if len(self.by_position) < proposed:
            grow = [0] * (proposed - len(self.by_position))
            self.by_position += grow
            self.proposed_by_position += grow
        for i in range(proposed):
            self.proposed_by_position[i] += 1
            self.by_position[i] += i < accepted

    @property
    def acceptance_length(self) -> float:
        """Tokens per verifying step, the target's own token included (the TensorRT-LLM guided + speculative article's
        "acceptance length")."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        return dict(steps=self.steps, proposed=self.proposed, accepted=self.accepted,
                    acceptance_length=round(self.acceptance_length, 4),
                    rate_by_position=[round(a / p, 4) for a, p in zip(self.by_position, self.proposed_by_position)])
