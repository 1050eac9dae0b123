"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, optional grammar bitmask.

All of it is batched tensor code with no host sync, so it can live inside a CUDA graph. Randomness is a
counter-based hash of (request seed, output index, token id): a request's draws do not depend on which
other requests share its batch, on preemption, or on the device, so a seed reproduces its tokens.
"""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
NO_TOKEN = -1   # sampled for a row whose bitmask allowed nothing; the carry-over reads it as token 0


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # int64 arithmetic on 32-bit values: every product stays below 2**59, so nothing overflows.
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, vocab] uniforms in (0, 1), a pure function of (seed, step, token id)."""
    row = _mix32(_mix32(seeds & _M32) ^ (steps & _M32))
    tok = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    return unit_interval(_mix32(_mix32(row[:, None] ^ tok[None, :]) + 0x9E3779B9 & _M32))


def unit_interval(h: torch.Tensor) -> torch.Tensor:
    """32-bit hashes -> float32 strictly inside (0, 1). Only 23 bits: with 24, (2**24 - 1) + 0.5 rounds to
    2**24 in float32, a uniform of exactly 1, an exponential of 0, and 0 / 0 = NaN in the race below, which
    argmax picks: a token outside the mask or top-p won about once per 300 rows sampled."""
    return ((h >> 9).float() + 0.5) * (1.0 / (1 << 23))


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """bitmask: int32 [N, ceil(V/32)] in xgrammar's layout (bit j of word w allows token 32w+j).
    Returns which rows allow some token. A row that allows none is left unmasked (no all -inf row, so no
    NaN from softmax); `sample` turns its token into NO_TOKEN so the engine fails that request alone."""
    vocab = logits.shape[-1]
    bits = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab]
    satisfiable = allowed.any(dim=-1)
    logits.masked_fill_(~allowed & satisfiable[:, None], float("-inf"))
    return satisfiable


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Return logits with tokens outside each row's top-k, then top-p, set to -inf."""
    vocab = logits.shape[-1]
    sorted_logits, _ = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    pos = torch.arange(vocab, device=logits.device)
    sorted_logits = sorted_logits.masked_fill(pos[None, :] >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs            # mass of strictly higher-ranked tokens
    # top_p >= 1 keeps the whole top-k: in float32 the cumulative mass reaches 1 before the tail's last tokens
    keep = ((before < top_p[:, None]) | (top_p[:, None] >= 1.0)) & (pos[None, :] < k[:, None])
    keep[:, 0] = True
    num_keep = keep.sum(dim=-1, keepdim=True)
    threshold = sorted_logits.gather(1, num_keep - 1)
    return logits.masked_fill(logits < threshold, float("-inf"))


def may_filter(top_k: torch.Tensor, top_p: torch.Tensor) -> bool:
    """Whether some row keeps less than the whole vocabulary. Asked only on the host (the CPU device): on CUDA the
    answer would be a sync, so the filter always runs there (for such rows an exact no-op) and can be captured.
    On the CPU the sort it skips is a third of a sampled step of a small model."""
    if top_k.device.type != "cpu":
        return True
    return bool((top_k > 0).any() or (top_p < 1.0).any())


def sample(logits, temperature, top_k, top_p, seeds, steps, bitmask=None, all_greedy=False, masker=apply_bitmask,
           min_p=None):
    """logits [N, V] float32 -> tokens [N] int64. Rows with temperature 0 are greedy; a row whose bitmask
    allows no token gets NO_TOKEN. `masker`: apply_bitmask or a kernel with its semantics
    (engine/kernels/sampling/bitmask.py). min_p [N] (None: off): after temperature, top-k and top-p, tokens less likely
    than min_p times the most likely one are dropped."""
    satisfiable = masker(logits, bitmask) if bitmask is not None else None
    tokens = logits.argmax(dim=-1)
    if not all_greedy:
        scaled = logits / temperature.clamp(min=1e-6)[:, None]
        if may_filter(top_k, top_p):
            scaled = filter_top_k_top_p(scaled, top_k, top_p)
        probs = scaled.softmax(dim=-1)
        if min_p is not None:
            probs = probs.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)
        exp_noise = -torch.log(uniform_noise(seeds, steps, logits.shape[-1]))
        sampled = (probs / exp_noise).argmax(dim=-1)       # exponential race == Gumbel-max
        tokens = torch.where(temperature > 0, sampled, tokens)
    return tokens if satisfiable is None else torch.where(satisfiable, tokens, NO_TOKEN)
