"""Grammar bitmask applied to logits in one Triton kernel (engine.sampling.sampler.apply_bitmask is its torch twin).

The torch version unpacks the bitmask into a [N, V] bool tensor, reduces it and fills: ~7 kernels per guided step.
Here one program per row first ORs the row's words (bits past the vocabulary ignored) to learn whether any token is
allowed, then sets every disallowed logit to -inf, unless none is allowed: such a row stays unmasked and is reported
unsatisfiable, so the sampler gives it NO_TOKEN instead of a NaN. No host sync, shapes only in the grid: capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import is_interpreted, reduce_sum

_WORDS_BLOCK = 512
_TOKENS_BLOCK = 2048


@triton.jit
def _apply_bitmask_kernel(logits_ptr, mask_ptr, sat_ptr, stride_logits, stride_mask, vocab, words,
                          WORDS_BLOCK: tl.constexpr, TOKENS_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    nonzero = tl.zeros([WORDS_BLOCK], dtype=tl.int32)
    for w0 in range(0, words, WORDS_BLOCK):
        w = w0 + tl.arange(0, WORDS_BLOCK)
        word = tl.load(mask_ptr + row * stride_mask + w, mask=w < words, other=0).to(tl.int64) & 0xFFFFFFFF
        inside = tl.minimum(tl.maximum(vocab - w * 32, 0), 32).to(tl.int64)    # bits of the word in the vocab
        valid = tl.where(inside >= 32, 0xFFFFFFFF, (tl.full([WORDS_BLOCK], 1, tl.int64) << inside) - 1)
        nonzero += ((word & valid) != 0).to(tl.int32)
    satisfiable = reduce_sum(nonzero, 0) > 0
    tl.store(sat_ptr + row, satisfiable.to(tl.int8))
    if satisfiable:
        for t0 in range(0, vocab, TOKENS_BLOCK):
            t = t0 + tl.arange(0, TOKENS_BLOCK)
            inside = t < vocab
            word = tl.load(mask_ptr + row * stride_mask + t // 32, mask=inside, other=-1)
            allowed = ((word >> (t % 32)) & 1) != 0
            tl.store(logits_ptr + row * stride_logits + t, float("-inf"), mask=inside & ~allowed)


def interpreted() -> bool:
    """True when the kernel was built for the Triton CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return is_interpreted(_apply_bitmask_kernel)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """In place, as engine.sampling.sampler.apply_bitmask: logits [N, V] float, bitmask int32 [N, >= ceil(V/32)]
    (xgrammar's layout). Returns the rows that allow some token (bool [N])."""
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"logits {tuple(logits.shape)} and bitmask {tuple(bitmask.shape)} must be [N, V] and [N, W]")
    if bitmask.dtype != torch.int32 or bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(f"bitmask must be int32 with at least {-(-logits.shape[1] // 32)} words per row, got "
                         f"{bitmask.dtype} {tuple(bitmask.shape)}")
    if logits.stride(-1) != 1 or bitmask.stride(-1) != 1:
        raise ValueError("logits and bitmask need unit stride in their last dim")
    n, vocab = logits.shape
    satisfiable = torch.empty(n, dtype=torch.int8, device=logits.device)
    if n:
        _apply_bitmask_kernel[(n,)](logits, bitmask, satisfiable, logits.stride(0), bitmask.stride(0), vocab,
                                    -(-vocab // 32), WORDS_BLOCK=_WORDS_BLOCK, TOKENS_BLOCK=_TOKENS_BLOCK)
    return satisfiable.view(torch.bool)            # the kernel stores 0 / 1: a view, not a conversion kernel
