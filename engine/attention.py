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
from engine.kernels.routes import RouteTable
from engine.lm_head import HEAD_OPS, HeadArgmax


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
    def linear(self, x, weight, bias=None, meta=None, add=None):
        out = linear(x, weight, bias)
        return out if add is None else add + out

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

    def norm_linear_argmax(self, x, norm_weight, eps, weight, ids=None):
        """linear(rms_norm(x)).float().argmax(-1) (int64, the first maximum; ids[it] where an int64 map of
        weight's rows is given) in kernels of the backend's, or None where it has none for the call: the caller
        computes the logits."""
        return None

    def linear_argmax(self, x, weight, ids=None):
        """linear(x).float().argmax(-1) (int64, the first maximum; ids[it] as norm_linear_argmax's) in kernels
        of the backend's, or None where it has none for the call."""
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


SEMAPHORES = 1024   # split_merge's counters, one a group of a merging launch: its programs fit one an SM


class TritonAttention(HeadArgmax, _Matmuls):
    """Triton kernels (CUDA, or the CPU under TRITON_INTERPRET=1). Each matmul and LM head runs the kernel its
    route table names for the call's (op, N, K, rows) where that kernel takes the call, else cuBLAS
    (engine/kernels/routes.py)."""
    name = "triton"
    fused = True       # the model takes its fused path (engine.kernels.fused_ops)

    def __init__(self, routes: RouteTable | None = None, rope_attention: bool = False, split_merge: bool = False,
                 decode_attention: bool = False, decode_attention_splits: int = 0, decode_attention_prefetch: int = 0,
                 device=None):
        from engine.kernels.sampling import argmax, bitmask
        from engine.kernels.matmul import decode_gemm, decode_gemv, draft_gemv, head_mma
        from engine.kernels.attention import decode_attention as decode_attn, paged_attention
        from engine.kernels import fused_ops
        self.routes = routes if routes is not None else RouteTable()
        self._k = paged_attention
        self._mods = {"gemv": decode_gemv, "gemm": decode_gemm}     # the matmul kernels by route name
        self._draft, self._mma = draft_gemv, head_mma                # the heads' ("gemv", "mma")
        self._rope_attention = rope_attention           # RoPE + KV store in the attention kernel where it fits
        self._decode_attn = decode_attn if decode_attention else None     # rope_attend of steps of <= 1 token a row
        self._decode_splits = decode_attention_splits or None              # None: by rule
        self._decode_prefetch = decode_attention_prefetch                  # its cached tiles read before the wait
        # split_merge: the counters of split attention's groups, zero between kernels (each launch leaves them so);
        # the kernels that use them run one after another on the compute stream
        self._semaphores = torch.zeros(SEMAPHORES, dtype=torch.int32, device=device) if split_merge else None
        self.apply_bitmask = bitmask.apply_bitmask      # the sampler's grammar mask, one kernel
        self._argmax = argmax
        self.ops = fused_ops

    def can_run(self, kernel: str, op: str, x, weight, k: int | None = None, norm_weight=None, residual=None,
                add=None) -> bool:
        """Whether `kernel` takes this call of `op` (k: the matmul's K where x is wider, as gate_up for SiLU)."""
        if kernel == "cublas":
            return True
        if op in HEAD_OPS:
            if kernel == "mma":
                return self._mma.supports(x, weight)
            if kernel != "gemv":
                return False
            return self._draft.supports(x, norm_weight, weight) if op == "norm_head" \
                else self._draft.supports_linear(x, weight)
        mod = self._mods.get(kernel)
        if mod is None:
            return False
        limit = {"max_k": mod.MAX_K_PLAIN} if kernel == "gemv" and op == "linear" else {}
        return mod.supports(x, weight, k=k, norm_weight=norm_weight, residual=residual, add=add, **limit) and (
            op != "norm_linear_silu" or mod.silu_mul_fits(weight))

    def kernel_for(self, op: str, x, weight, k: int | None = None, **kw) -> str:
        """The kernel that runs this call: its route's where that kernel takes it, else cuBLAS."""
        k = k or x.shape[-1]
        kernel = self.routes.lookup(op, weight.shape[0], k, x.shape[0])
        return kernel if self.can_run(kernel, op, x, weight, k=k, **kw) else "cublas"

    def _launch(self, kernel: str, meta) -> dict:
        """decode_gemm's keywords for this step: a decode step's (one token a sequence) take its own launch rule,
        which gains there and loses in a verification step of the same rows (decode_gemm.DECODE_PROGRAMS)."""
        return {"decode": True} if kernel == "gemm" and meta is not None and meta.max_query_len == 1 else {}

    def linear(self, x, weight, bias=None, meta=None, add=None):
        """x @ weight.T (+ bias), plus `add` where given (rounded as the two torch ops round it)."""
        kernel = "cublas" if bias is not None else self.kernel_for("linear", x, weight, add=add)
        if kernel == "gemv":
            return self._mods["gemv"].decode_linear(x, weight, add)
        out = self._mods["gemm"].decode_linear(x, weight, **self._launch(kernel, meta)) if kernel == "gemm" \
            else super().linear(x, weight, bias)
        return out if add is None else add + out

    def norm_linear(self, x, residual, norm_weight, eps, weight, bias=None, meta=None):
        kernel = "cublas" if bias is not None else self.kernel_for("norm_linear", x, weight, norm_weight=norm_weight,
                                                                   residual=residual)
        if kernel == "cublas":
            return super().norm_linear(x, residual, norm_weight, eps, weight, bias)
        return self._mods[kernel].decode_norm_linear(x, norm_weight, eps, weight, residual,
                                                     **self._launch(kernel, meta))

    def norm_linear_silu(self, x, residual, norm_weight, eps, weight, meta=None):
        """(silu(gate) * up of norm_linear(x, residual, ..., weight = [gate; up]), the new residual)."""
        kernel = self.kernel_for("norm_linear_silu", x, weight, norm_weight=norm_weight, residual=residual)
        if kernel == "cublas":
            gate_up, residual = super().norm_linear(x, residual, norm_weight, eps, weight)
            return self.ops.silu_mul(gate_up), residual
        return self._mods[kernel].decode_norm_linear_silu(x, norm_weight, eps, weight, residual,
                                                          **self._launch(kernel, meta))

    def silu_linear(self, gate_up, weight, residual=None, meta=None):
        return self.linear(self.ops.silu_mul(gate_up), weight, meta=meta, add=residual)

    def norm_mlp(self, x, residual, norm_weight, eps, gate_up_weight, down_weight, add_residual: bool = False,
                 meta=None):
        act, residual = self.norm_linear_silu(x, residual, norm_weight, eps, gate_up_weight, meta=meta)
        return self.linear(act, down_weight, meta=meta, add=residual if add_residual else None), residual

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


def make_backend(name: str, **options):
    """The attention backend `name`; `options` (TritonAttention's keywords) configure the Triton one."""
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        return TritonAttention(**options)
    raise ValueError(f"unknown attention backend {name!r}")
