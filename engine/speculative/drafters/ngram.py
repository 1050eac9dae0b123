"""N-gram (prompt lookup) drafting: guess that the text continues as it did after the last time its newest
few tokens appeared.

For each row, take the longest n in [max_n .. min_n] for which the row's last n tokens occur earlier in
the row (an occurrence ending before the final position; it may overlap the suffix itself), choose the most
recent such occurrence, and propose the up to k tokens that followed it.

Most recent rather than earliest: vLLM's prompt lookup takes the earliest occurrence of the longest match,
SGLang looks the suffix up in a trie of past tokens and ranks continuations by frequency. We take the most
recent because the workloads this engine serves (tool calls, JSON with repeated records, code edits) repeat
their latest structure: the last record, the latest version of an edited line, predicts the next one better
than the first. The price: in a periodic run (e.g. "a a a a") the most recent occurrence sits just before
the end, so its continuation is cut short by the history's end and the row gets fewer than k drafts where
the earliest occurrence would have given k.

Everything is batched tensor code with no host sync and output shapes fixed by (N, k), so it can be
captured in the step's CUDA graph; it runs unchanged on the CPU.
"""
from __future__ import annotations

import torch

from engine.speculative.drafters.base import DraftContext, Drafter, Proposal

PAD_TOKEN = 0   # draft positions past num_drafts hold this (a valid id, so the target can embed it)


def _check_args(k, min_n, max_n) -> None:
    for name, value in (("k", k), ("min_n", min_n), ("max_n", max_n)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")


def suffix_match_lengths(history: torch.Tensor, lengths: torch.Tensor, max_n: int) -> torch.Tensor:
    """history [N, L], lengths [N] int64 in [0, L] -> [N, L] int64: entry (r, e) is the largest j <= max_n
    such that the j tokens ending at position e equal row r's last j valid tokens. Only entries with
    e <= lengths[r] - 2 are meaningful; the caller masks the rest. Time O(N * L * max_n), memory O(N * L)."""
    n_rows, seq = history.shape
    match = torch.zeros(n_rows, seq, dtype=torch.int64, device=history.device)
    run = torch.ones(n_rows, seq, dtype=torch.bool, device=history.device)
    # Invariant after iteration j: run[r, e] <=> history[r, e - i] == history[r, lengths[r] - 1 - i] for all
    # i <= j. A window of j + 1 tokens fits only from e >= j, hence the shifted compare. For a meaningful e
    # (<= lengths[r] - 2) that gives tail = lengths[r] - 1 - j >= 1, so the clamp only touches masked entries.
    for j in range(min(max_n, seq)):
        tail = lengths - 1 - j                                        # [N] position of the j-th-last token
        token = history.gather(1, tail.clamp(min=0)[:, None])         # [N, 1]
        eq = torch.zeros_like(run)
        eq[:, j:] = history[:, :seq - j] == token
        run = run & eq
        match += run
    return match


def ngram_propose(history: torch.Tensor, lengths: torch.Tensor, k: int, min_n: int = 1, max_n: int = 3):
    """history [N, L] integer token ids, lengths [N] integer valid tokens per row (see DraftContext)
    -> (draft_tokens [N, k] int64, num_drafts [N] int64).

    Row r's drafts are the up to k tokens that followed the most recent earlier occurrence of its longest
    matching suffix n-gram (min_n <= n <= max_n); num_drafts[r] counts those inside lengths[r] (at least 1
    when there is a match, 0 when none). draft_tokens[r, num_drafts[r]:] is PAD_TOKEN (0).
    Lengths outside [0, L] are clamped into it, not rejected (checking would sync)."""
    _check_args(k, min_n, max_n)
    if history.dim() != 2 or lengths.shape != history.shape[:1]:
        raise ValueError(f"need history [N, L] and lengths [N], got {tuple(history.shape)} and "
                         f"{tuple(lengths.shape)}")
    if history.is_floating_point() or history.is_complex() or lengths.is_floating_point():
        raise ValueError(f"history and lengths must be integer tensors, got {history.dtype}, {lengths.dtype}")
    n_rows, seq = history.shape
    device = history.device
    if seq < 2:     # a static shape: no occurrence can end before the last position
        return (torch.zeros(n_rows, k, dtype=torch.int64, device=device),
                torch.zeros(n_rows, dtype=torch.int64, device=device))
    lengths = lengths.to(torch.int64).clamp(0, seq)
    pos = torch.arange(seq, device=device)
    match = suffix_match_lengths(history, lengths, max_n)
    eligible = (match >= min_n) & (pos[None, :] <= lengths[:, None] - 2)
    # Longest match first, then the most recent: pos < seq keeps the order lexicographic, so the max is unique.
    score = torch.where(eligible, match * seq + pos[None, :], -1)
    best, end = score.max(dim=1)
    start = end + 1                                                   # first token after the occurrence
    num_drafts = torch.where(best >= 0, (lengths - start).clamp(0, k), 0)
    offsets = torch.arange(k, device=device)
    drafts = history.gather(1, (start[:, None] + offsets).clamp(max=seq - 1)).to(torch.int64)
    drafts = drafts.masked_fill(offsets[None, :] >= num_drafts[:, None], PAD_TOKEN)
    return drafts, num_drafts


class NgramDrafter(Drafter):
    """Prompt-lookup drafter: deterministic, no model, no state between steps. spec_kernels: the search in one
    Triton kernel that reads the context's table in place (engine/kernels/speculative/ngram_draft.py)."""

    name = "ngram"

    def __init__(self, k: int, min_n: int = 1, max_n: int = 3, spec_kernels: bool = False):
        _check_args(k, min_n, max_n)
        self.num_speculative_tokens = k
        self.min_n = min_n
        self.max_n = max_n
        self.spec_kernels = spec_kernels

    def propose(self, ctx: DraftContext) -> Proposal:
        k, min_n, max_n = self.num_speculative_tokens, self.min_n, self.max_n
        if self.spec_kernels:
            from engine.kernels.speculative.ngram_draft import ngram_draft
            rows = ctx.rows if ctx.rows is not None else torch.arange(ctx.history.shape[0], device=ctx.history.device)
            return Proposal(*ngram_draft(ctx.history, rows, ctx.lengths, k, min_n, max_n))
        return Proposal(*ngram_propose(ctx.table(), ctx.lengths, k, min_n, max_n))

    def __repr__(self) -> str:
        return f"NgramDrafter(k={self.num_speculative_tokens}, min_n={self.min_n}, max_n={self.max_n})"
