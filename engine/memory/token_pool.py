"""The device-side token pool: per sequence, the tokens its next step reads that the host has not seen yet.

The pipelined loop plans step t + 1 before step t's tokens reach the host, so a sequence's newest token (and,
speculating, the drafts for its next step) stays on the device. Each sequence holding KV pages owns a row,
handed out by `engine.memory.row_pool.RowPool` with its pages (`seq.pool_row`):
- `last_token[row]`: the last token the sequence's latest step emitted (written by that step's sampling or
  verification);
- `drafts[row, :K]`, `draft_count[row]`: the drafter's guesses for its next step (engine/speculative/).
A step's input t names where its id comes from, for plain and speculative steps alike (engine/runner/slots.py):
`carry_src[t]` = -1 the host's `input_ids[t]`, 0 the last token of row `tok_row[t]`, j >= 1 its draft j.
Row `dummy` (the last) absorbs the reads and writes of graph padding rows: the host names them -1, which
tensor indexing wraps to the last row (no remapping kernels in the step). A row's writes and the reads of its
next step are ordered on the one compute stream; a new owner reads nothing of a row it has not written first.
"""
from __future__ import annotations

import torch


class TokenPool:
    def __init__(self, num_rows: int, k: int, device: torch.device):
        self.num_rows, self.k = num_rows, k
        self.dummy = num_rows       # the last row: where index -1 (padding) lands
        rows = num_rows + 1
        self.last_token = torch.zeros(rows, dtype=torch.int64, device=device)
        self.drafts = torch.zeros(rows, max(k, 1), dtype=torch.int64, device=device)
        self.draft_count = torch.zeros(rows, dtype=torch.int64, device=device)

    def carried(self, ids: torch.Tensor, carry_src: torch.Tensor, tok_rows: torch.Tensor) -> torch.Tensor:
        """The step's input ids: the host's where carry_src is -1, else the pool's (see the module docstring)."""
        carried = self.last_token[tok_rows]
        if self.k:
            drafted = self.drafts[tok_rows, (carry_src - 1).clamp(0, self.drafts.shape[1] - 1)]
            carried = torch.where(carry_src == 0, carried, drafted)
        return torch.where(carry_src >= 0, carried, ids)

    def emit(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Each sampling row's last emitted token. A NO_TOKEN (-1: a failed row, whose request fails at commit)
        carries as token 0, so the embedding lookup of the step it rides in stays in range."""
        self.last_token[rows] = tokens.clamp(min=0)
