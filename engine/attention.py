"""Attention over a paged KV cache: the metadata both backends read, and the torch reference.

Layout (per layer): k_cache, v_cache are [num_blocks, block_size, num_kv_heads, head_dim].
A step holds B sequences with a variable number of new (query) tokens each, flattened to T tokens.
Sequence i's new tokens are q[cu_seqlens_q[i]:cu_seqlens_q[i+1]]; its KV length after this step is
seq_lens[i], so its j-th new token sits at position seq_lens[i] - q_len_i + j and attends to
positions 0..that position (causal). New K/V are written to the cache first (slot_mapping, -1 = no
write, used by padding rows), then attention reads everything from the pages.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from engine.kernels.matmul.cpu_gemm import linear
from engine.lm_head import HeadArgmax


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor   # [T] int64: block * block_size + offset, or -1
    cu_seqlens_q: torch.Tensor   # [B+1] int32
    seq_lens: torch.Tensor       # [B] int32, KV length after this step
    block_tables: torch.Tensor   # [B, max_blocks] int32
    max_query_len: int           # host-known upper bound of the per-sequence query length
    max_seq_len: int             # host-known upper bound of seq_lens


def store_kv_torch(k, v, k_cache, v_cache, slot_mapping):
    """Write new keys/values into their cache slots; rows with slot -1 write nothing."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[valid].to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[valid].to(v_cache.dtype))


def paged_attention_torch(q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
    """Reference: gathers each sequence's pages and runs dense causal attention in float32, one sequence at a time
    (a row's result does not depend on the sequences beside it). The query heads sharing a KV head are one
    matmul against it (no copies of the keys per query head)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    cu = meta.cu_seqlens_q.tolist()
    lens = meta.seq_lens.tolist()
    tables = meta.block_tables.long()
    for i, kv_len in enumerate(lens):
        q_start, q_end = cu[i], cu[i + 1]
        n = q_end - q_start
        if n == 0:
            continue
        blocks = tables[i, :(kv_len + block_size - 1) // block_size]
        k = k_cache[blocks].flatten(0, 1)[:kv_len].float().permute(1, 2, 0)       # [kv heads, head_dim, kv_len]
        v = v_cache[blocks].flatten(0, 1)[:kv_len].float().transpose(0, 1)        # [kv heads, kv_len, head_dim]
        # [kv heads, group * n, head_dim]: query row r of a KV head is its head r // n, token r % n
        qi = q[q_start:q_end].float().view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        scores = torch.bmm(qi.reshape(num_kv_heads, group * n, head_dim), k) * scale
        if n > 1:                   # token t sees keys up to its position kv_len - n + t: among the last n keys
            causal = torch.ones(n, n, dtype=torch.bool, device=q.device).triu_(1)
            scores.view(num_kv_heads, group, n, kv_len)[..., kv_len - n:].masked_fill_(causal, float("-inf"))
        o = torch.bmm(scores.softmax(-1), v).view(num_kv_heads, group, n, head_dim)
        out[q_start:q_end] = o.permute(2, 0, 1, 3).reshape(n, num_heads, head_dim).to(q.dtype)
    return out


class _Matmuls:
    """The matmuls of a layer with the op before them, on `self.ops` (the fused-op kernels or their torch
    references) and cuBLAS; attention with RoPE and the KV store before it."""

    def rope_attend(self, q, k, v, positions, rope_cache, k_cache, v_cache, meta, scale):
        """attend() on q and the step's new keys k and values v (q, k not yet rotated, k, v not yet cached), as
        ops.rope_store_kv then attend()."""
        q = self.ops.rope_store_kv(q, k, v, positions, *rope_cache, k_cache, v_cache, meta.slot_mapping)
        return self.attend(q, k_cache, v_cache, meta, scale)

    # meta: the step's AttentionMetadata where the caller has it; a backend may choose its kernels' launch by it
    def linear(self, x, weight, bias=None, meta=None):
        return linear(x, weight, bias)

    def norm_linear(self, x, residual, norm_weight, eps, weight, bias=None, meta=None):
        """(linear(rms_norm(x [+ residual])), the new residual: x + residual, or x itself without one)."""
        if residual is None:
            return linear(self.ops.rms_norm(x, norm_weight, eps), weight, bias), x
        normed, residual = self.ops.rms_norm(x, norm_weight, eps, residual)
        return linear(normed, weight, bias), residual

    def silu_linear(self, gate_up, weight, residual=None, meta=None):
        """linear(silu_mul(gate_up)), plus the residual when one is given."""
        out = linear(self.ops.silu_mul(gate_up), weight)
        return out if residual is None else residual + out

    def norm_mlp(self, x, residual, norm_weight, eps, gate_up_weight, down_weight, add_residual: bool = False,
                 meta=None):
        """The MLP after a norm: (silu_linear(norm_linear(x, residual, ...)), the new residual), with the new
        residual added to the output where add_residual (the EAGLE head's)."""
        gate_up, residual = self.norm_linear(x, residual, norm_weight, eps, gate_up_weight, meta=meta)
        return self.silu_linear(gate_up, down_weight, residual if add_residual else None, meta=meta), residual

    def norm_linear_argmax(self, x, norm_weight, eps, weight, gemv: bool = True, ids=None):
        """linear(rms_norm(x)).float().argmax(-1) (int64, the first maximum; ids[it] where an int64 map of
        weight's rows is given) in kernels of the backend's (`gemv`: the decode GEMV's too), or None where it
        has none for the call: the caller computes the logits."""
        return None

    def linear_argmax(self, x, weight, gemv: bool = True, ids=None):
        """linear(x).float().argmax(-1) (int64, the first maximum; ids[it] as norm_linear_argmax's) in kernels
        of the backend's (`gemv`: the decode GEMV's too), or None where it has none for the call."""
        return None


class TorchAttention(_Matmuls):
    """Runs anywhere; the correctness reference for every other backend."""
    name = "torch"
    fused = False      # the model takes its reference path (torch ops)

    def __init__(self):
        from engine.kernels import fused_ops
        self.ops = SimpleNamespace(rms_norm=fused_ops.rms_norm_ref, rope_store_kv=fused_ops.rope_store_kv_ref,
                                   silu_mul=fused_ops.silu_mul_ref)

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping):
        store_kv_torch(k, v, k_cache, v_cache, slot_mapping)

    def attend(self, q, k_cache, v_cache, meta, scale):
        return paged_attention_torch(q, k_cache, v_cache, meta, scale)


SPLIT_MIN_ROWS, SPLIT_MAX_WEIGHT = 3, 1 << 21      # TritonAttention._split_to_gemm (weight elements)
SEMAPHORES = 1024   # split_merge's counters, one a group of a merging launch: its programs fit one an SM


class TritonAttention(HeadArgmax, _Matmuls):
    """Triton kernels (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    name = "triton"
    fused = True       # the model takes its fused path (engine.kernels.fused_ops)

    def __init__(self, decode_gemv: bool = False, draft_gemv: bool = False, decode_gemm_rows: int = 0,
                 decode_gemv_rows: int = 4, decode_gemm_split: bool = False, rope_attention: bool = False,
                 split_merge: bool = False, silu_epilogue: bool = False, gemm_silu_epilogue: bool = False,
                 decode_attention: bool = False, decode_attention_splits: int = 0, decode_attention_prefetch: int = 0,
                 long_row_gemv: bool = False, long_k_gemv_rows: int = 8, head_mma: bool = False,
                 head_mma_from: int = 0, head_mma_to: int = 64, device=None):
        from engine.kernels.sampling import argmax, bitmask
        from engine.kernels.matmul import decode_gemm as gemm, decode_gemv as gemv, draft_gemv as draft, head_mma as mma
        from engine.kernels.attention import decode_attention as decode_attn, paged_attention
        from engine.kernels import fused_ops
        for name, on in (("draft_gemv", draft_gemv), ("long_row_gemv", long_row_gemv)):
            if on and not decode_gemv:
                raise ValueError(f"{name} runs on the decode GEMV: it needs decode_gemv")
        for name, rows in (("decode_gemv_rows", decode_gemv_rows), ("long_k_gemv_rows", long_k_gemv_rows)):
            if not 1 <= rows <= gemv.MAX_ROWS:
                raise ValueError(f"{name} must be 1 to {gemv.MAX_ROWS}, got {rows}")
        if decode_gemm_rows and not (decode_gemv and decode_gemv_rows < decode_gemm_rows <= gemm.MAX_ROWS):
            raise ValueError(f"decode_gemm_rows must be 0 or {decode_gemv_rows + 1} to {gemm.MAX_ROWS}, with "
                             f"decode_gemv; got {decode_gemm_rows}")
        if decode_gemm_split and not decode_gemv:
            raise ValueError("decode_gemm_split shares the decode GEMV's rows with decode_gemm: it needs decode_gemv")
        self._k, self._gemv = paged_attention, gemv if decode_gemv else None
        self._gemv_rows = decode_gemv_rows                  # steps of 1 .. _gemv_rows rows: the GEMV
        self._long_rows = long_row_gemv                     # and its matmuls without a prologue to MAX_K_PLAIN
        self._long_k_rows = long_k_gemv_rows                # but K past AT_ONCE_MAX_K only to these rows
        self._gemm = gemm if decode_gemm_rows or decode_gemm_split else None
        self._gemm_rows = decode_gemm_rows                  # steps of _gemv_rows + 1 .. _gemm_rows rows: decode_gemm
        self._split = decode_gemm_split                     # and in the GEMV's rows, see _split_to_gemm
        self._draft = draft if draft_gemv else None     # argmax (draft steps, verify_gemv) and residual epilogues
        self._head_mma = mma if head_mma else None      # the LM head's argmax past the GEMV's rows (lm_head.py)
        self._head_mma_from = head_mma_from or decode_gemv_rows + 1      # or from these rows
        self._head_mma_to = head_mma_to                                  # up to these rows
        self._rope_attention = rope_attention           # RoPE + KV store in the attention kernel where it fits
        self._silu_epilogue = silu_epilogue             # norm_mlp: SiLU * up in the GEMV of gate_up where it takes it
        self._gemm_silu_epilogue = gemm_silu_epilogue   # and in decode_gemm's where that takes it
        self._decode_attn = decode_attn if decode_attention else None     # rope_attend of steps of <= 1 token a row
        self._decode_splits = decode_attention_splits or None              # None: by rule
        self._decode_prefetch = decode_attention_prefetch                  # its cached tiles read before the wait
        # split_merge: the counters of split attention's groups, zero between kernels (each launch leaves them so);
        # the kernels that use them run one after another on the compute stream
        self._semaphores = torch.zeros(SEMAPHORES, dtype=torch.int32, device=device) if split_merge else None
        self.apply_bitmask = bitmask.apply_bitmask      # the sampler's grammar mask, one kernel
        self._argmax = argmax
        self.ops = fused_ops

    # engine/kernels/matmul/decode_gemv.py (the op before folded in) for steps of up to decode_gemv_rows rows when it
    # is on and there is no bias, decode_gemm.py for up to decode_gemm_rows rows, else the separate kernel and cuBLAS
    def _gemv_for(self, x, weight, bias, plain: bool = False, **kw):
        """The kernel module taking this call, or None. plain: no op before the matmul, so with long_row_gemv the
        GEMV takes rows up to its MAX_K_PLAIN. A K the GEMV takes one row at a time goes to cuBLAS in steps of more
        than long_k_gemv_rows rows: Llama 8B's 4-row step 9.68 -> 4.59 ms (H200, bench/results/rows_by_model/)."""
        if self._gemv is None or bias is not None:
            return None
        rows, k = x.shape[0], kw.get("k") or x.shape[-1]
        if rows <= self._gemv_rows:
            kernels = self._gemv
            if self._split and self._split_to_gemm(rows, weight.shape[0], k) and self._gemm.supports(x, weight, **kw):
                kernels = self._gemm
            elif rows > self._long_k_rows and self._gemv.one_row_at_a_time(k):
                return None
        elif self._gemm is not None and rows <= self._gemm_rows:
            kernels = self._gemm
        else:
            return None
        if plain and self._long_rows and kernels is self._gemv:
            kw["max_k"] = kernels.MAX_K_PLAIN
        return kernels if kernels.supports(x, weight, **kw) else None

    @staticmethod
    def _split_to_gemm(rows: int, n: int, k: int) -> bool:
        """decode_gemm_split: whether decode_gemm takes a matmul of the GEMV's rows: from 3 rows, a weight of at
        most SPLIT_MAX_WEIGHT elements. decode_gemm reads its weight tile before the dependent-launch wait; a small
        weight's programs all run at once, so the whole read overlaps the kernel before. SmolLM2's four (the
        largest, gate_up, 1.8 M) are faster there from 3 rows (4 streams 0.540 -> 0.499 ms a step,
        bench/results/head_rows/); Llama 1B's (the smallest, o, 4.2 M) are faster on the GEMV (1.32 against 1.68
        ms), whose many narrow programs read a large weight faster (H200, bench/results/rows_by_model/)."""
        return rows >= SPLIT_MIN_ROWS and n * k <= SPLIT_MAX_WEIGHT

    def _launch(self, kernels, meta) -> dict:
        """decode_gemm's keywords for this step: a decode step's (one token a sequence) take its own launch rule,
        which gains there and loses in a verification step of the same rows (decode_gemm.DECODE_PROGRAMS)."""
        return {"decode": True} if kernels is self._gemm and meta is not None and meta.max_query_len == 1 else {}

    def linear(self, x, weight, bias=None, meta=None):
        if kernels := self._gemv_for(x, weight, bias, plain=True):
            return kernels.decode_linear(x, weight, **self._launch(kernels, meta))
        return super().linear(x, weight, bias)

    def norm_linear(self, x, residual, norm_weight, eps, weight, bias=None, meta=None):
        if kernels := self._gemv_for(x, weight, bias, norm_weight=norm_weight, residual=residual):
            return kernels.decode_norm_linear(x, norm_weight, eps, weight, residual, **self._launch(kernels, meta))
        return super().norm_linear(x, residual, norm_weight, eps, weight, bias)

    def silu_linear(self, gate_up, weight, residual=None, meta=None):
        if residual is not None and self._draft is None:        # the residual epilogue is draft_gemv's
            return residual + self.silu_linear(gate_up, weight, meta=meta)
        if kernels := self._gemv_for(gate_up, weight, None, k=gate_up.shape[-1] // 2, add=residual):
            return kernels.decode_silu_linear(gate_up, weight, residual, **self._launch(kernels, meta))
        return super().silu_linear(gate_up, weight, residual)

    def norm_mlp(self, x, residual, norm_weight, eps, gate_up_weight, down_weight, add_residual: bool = False,
                 meta=None):
        gemv, kernels = self._gemv, self._gemv_for(x, gate_up_weight, None, norm_weight=norm_weight, residual=residual)
        if not (kernels is not None and kernels.silu_mul_fits(gate_up_weight) and
                (self._silu_epilogue if kernels is gemv else self._gemm_silu_epilogue)):
            return super().norm_mlp(x, residual, norm_weight, eps, gate_up_weight, down_weight, add_residual, meta)
        act, residual = kernels.decode_norm_linear_silu(x, norm_weight, eps, gate_up_weight, residual,
                                                        **self._launch(kernels, meta))
        add = residual if add_residual else None
        if add is not None and self._draft is not None and self._gemv_for(act, down_weight, None, add=add) is gemv:
            return gemv.decode_linear(act, down_weight, add), residual      # the residual epilogue is draft_gemv's
        out = self.linear(act, down_weight, meta=meta)
        return (out if add is None else add + out), residual

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping):
        self._k.store_kv(k, v, k_cache, v_cache, slot_mapping)

    def attend(self, q, k_cache, v_cache, meta, scale, rope=None):
        return self._k.paged_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
                                       scale, meta.max_query_len, max_seq_len=meta.max_seq_len, rope=rope,
                                       semaphores=self._semaphores)

    def rope_attend(self, q, k, v, positions, rope_cache, k_cache, v_cache, meta, scale):
        if self._decode_attn is not None and meta.max_query_len == 1 and q.shape[0] <= meta.seq_lens.shape[0]:
            return self._decode_attn.decode_attention(
                q, k, v, positions, *rope_cache, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
                meta.slot_mapping, scale, num_splits=self._decode_splits, max_seq_len=meta.max_seq_len,
                semaphores=self._semaphores, prefetch_tiles=self._decode_prefetch)
        if self._rope_attention and self._k.fuses_rope(q.shape[1], k_cache.shape[2], meta.max_query_len,
                                                       k_cache.shape[1]):
            return self.attend(q, k_cache, v_cache, meta, scale, rope=(k, v, positions, *rope_cache, meta.slot_mapping))
        return super().rope_attend(q, k, v, positions, rope_cache, k_cache, v_cache, meta, scale)


def make_backend(name: str, **switches):
    """The attention backend `name`; `switches` (TritonAttention's keywords) configure the Triton one."""
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        return TritonAttention(**switches)
    raise ValueError(f"unknown attention backend {name!r}")
