"""The backends the model runs each layer's matmuls, its LM head and attention on; EngineConfig's
attention_backend names one, make_backend builds it.

- TorchBackend ("torch"): torch ops, cuBLAS for every matmul and engine/attention.py's reference attention. It runs
  anywhere and is the correctness reference for the other.
- RoutedBackend ("triton"): routes each matmul and LM head to the kernel its route table names for the call's
  (op, N, K, rows) where that kernel takes the call, else to cuBLAS (engine/kernels/routes.py); attention, RoPE
  and the KV store run on the Triton kernels of engine/kernels/attention/ (CUDA, or the CPU under
  TRITON_INTERPRET=1).

A greedy step may ask the backend for its tokens without float32 logits (norm_linear_argmax, linear_argmax): the
routed backend runs the head's routed kernel ("gemv": draft_gemv's argmax epilogue on the decode GEMV, the final
norm as its prologue for an EAGLE draft's "norm_head"; "mma": head_mma's argmax on tensor cores; "cublas": cuBLAS's
logits and engine/kernels/sampling/argmax.py's two kernels, without the logits' float32 copy). The torch backend
and the reference route table have none: the step computes its logits and samples from them.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.attention import paged_attention_torch, store_kv_torch
from engine.kernels.matmul.cpu_gemm import linear
from engine.kernels.routes import STREAM_KERNELS, RouteTable

HEAD_OPS = ("head", "norm_head")        # the route table's LM head ops


class _Matmuls:
    """What every backend does, on cuBLAS and `self.ops` (the fused-op kernels or their torch references): the
    matmuls of a layer with the op before them, attention with RoPE and the KV store before it. RoutedBackend
    takes another kernel where its route names one."""

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
        normed, residual = self._norm(x, residual, norm_weight, eps)
        return linear(normed, weight, bias), residual

    def _norm(self, x, residual, norm_weight, eps):
        """(rms_norm(x [+ residual]), the new residual: x + residual, or x itself without one)."""
        if residual is None:
            return self.ops.rms_norm(x, norm_weight, eps), x
        return self.ops.rms_norm(x, norm_weight, eps, residual)

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

    def norm_linear_argmax(self, x, norm_weight, eps, weight, ids=None, out=None):
        """linear(rms_norm(x)).float().argmax(-1) (int64, the first maximum; ids[it] where an int64 map of
        weight's rows is given) in kernels of the backend's, or None where it has none for the call: the caller
        computes the logits. The kernels may write the tokens into `out` (int64 [M], unit stride): the caller
        checks whether the result is `out`."""
        return None

    def linear_argmax(self, x, weight, ids=None):
        """linear(x).float().argmax(-1) (int64, the first maximum; ids[it] as norm_linear_argmax's) in kernels
        of the backend's, or None where it has none for the call."""
        return None

    def norm_linear_top(self, x, norm_weight, eps, weight, n: int, ids=None):
        """The n largest columns of linear(rms_norm(x)) a row, best first (int64 [M, n]; ids[them] as
        norm_linear_argmax's) in kernels of the backend's, or None where it has none for the call."""
        return None


class TorchBackend(_Matmuls):
    """Torch ops and cuBLAS everywhere: runs anywhere, and every other path is checked against it."""
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
TILE_COUNTERS = 1024    # stream_split's counters, one a weight tile (zero between launches, as the semaphores)


class RoutedBackend(_Matmuls):
    """Each matmul and LM head on its routed kernel, attention on Triton's."""
    name = "triton"
    fused = True       # the model takes its fused path (engine.kernels.fused_ops)

    def __init__(self, routes: RouteTable | None = None, rope_attention: bool = False, split_merge: bool = False,
                 decode_attention: bool = False, decode_attention_splits: int = 0, decode_attention_prefetch: int = 0,
                 verify_attention: bool = False, device=None):
        from engine.kernels.sampling import argmax, bitmask, topk
        from engine.kernels.matmul import decode_gemm, decode_gemv, draft_gemv, head_mma, stream_gemm
        from engine.kernels.attention import decode_attention as decode_attn, paged_attention
        from engine.kernels.attention import verify_attention as verify
        from engine.kernels import fused_ops
        self.routes = routes if routes is not None else RouteTable()
        self._k = paged_attention
        self._mods = {"gemv": decode_gemv, "gemm": decode_gemm}     # the matmul kernels by route name
        self._draft, self._mma = draft_gemv, head_mma                # the heads' ("gemv", "mma")
        self._stream = stream_gemm                                   # "stream*": the norm and SiLU folded in
        self._rope_attention = rope_attention           # RoPE + KV store in the attention kernel where it fits
        self._decode_attn = decode_attn if decode_attention else None     # rope_attend of steps of <= 1 token a row
        self._decode_splits = decode_attention_splits or None              # None: by rule
        self._decode_prefetch = decode_attention_prefetch                  # its cached tiles read before the wait
        self._verify_attn = verify if verify_attention else None     # rope_attend of a few rows of a few tokens
        # split_merge: the counters of split attention's groups, zero between kernels (each launch leaves them so);
        # the kernels that use them run one after another on the compute stream
        self._semaphores = torch.zeros(SEMAPHORES, dtype=torch.int32, device=device) if split_merge else None
        self._tile_counters = torch.zeros(TILE_COUNTERS, dtype=torch.int32, device=device)     # stream_split's
        self.apply_bitmask = bitmask.apply_bitmask      # the sampler's grammar mask, one kernel
        self._argmax, self._topk = argmax, topk
        self.ops = fused_ops
        self.stack = None       # the persistent decode stack (engine/kernels/persistent/stack.py), where routed

    def decode_stack(self, model, x, meta, aux_layers=()):
        """The persistent decode stack for this forward of `model` (x: its embedded inputs, one row a token), where
        the table routes its rows there, it is the model the stack was built for, with the aux layers it was built
        for (or none asked), and no draft tree; else None."""
        stack = self.stack
        if stack is None or stack.model is not model or meta.tree_masks is not None or x.shape[0] > stack.max_rows:
            return None
        if aux_layers and tuple(aux_layers) != stack.aux_layers:
            return None
        rows = x.shape[0]
        return stack if self.routes.lookup("stack", stack.hidden, stack.inter, rows) == "persistent" else None

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
        if kernel in STREAM_KERNELS:
            return self._stream.supports(x, weight, norm_weight, residual, silu=op == "norm_linear_silu",
                                         variant=STREAM_KERNELS[kernel], counters=self._tile_counters)
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
        if kernel in STREAM_KERNELS:
            out = self._stream.linear(x, weight, STREAM_KERNELS[kernel], self._tile_counters)
            return out if add is None else add + out
        out = self._mods["gemm"].decode_linear(x, weight, **self._launch(kernel, meta)) if kernel == "gemm" \
            else super().linear(x, weight, bias)
        return out if add is None else add + out

    def norm_linear(self, x, residual, norm_weight, eps, weight, bias=None, meta=None):
        kernel = "cublas" if bias is not None else self.kernel_for("norm_linear", x, weight, norm_weight=norm_weight,
                                                                   residual=residual)
        if kernel == "cublas":
            return super().norm_linear(x, residual, norm_weight, eps, weight, bias)
        if kernel in STREAM_KERNELS:
            return self._stream.norm_linear(x, norm_weight, eps, weight, residual, STREAM_KERNELS[kernel],
                                            self._tile_counters)
        return self._mods[kernel].decode_norm_linear(x, norm_weight, eps, weight, residual,
                                                     **self._launch(kernel, meta))

    def norm_linear_silu(self, x, residual, norm_weight, eps, weight, meta=None):
        """(silu(gate) * up of norm_linear(x, residual, ..., weight = [gate; up]), the new residual)."""
        kernel = self.kernel_for("norm_linear_silu", x, weight, norm_weight=norm_weight, residual=residual)
        if kernel == "cublas":
            gate_up, residual = super().norm_linear(x, residual, norm_weight, eps, weight)
            return self.ops.silu_mul(gate_up), residual
        if kernel in STREAM_KERNELS:
            return self._stream.norm_linear_silu(x, norm_weight, eps, weight, residual, STREAM_KERNELS[kernel],
                                                 self._tile_counters)
        return self._mods[kernel].decode_norm_linear_silu(x, norm_weight, eps, weight, residual,
                                                          **self._launch(kernel, meta))

    def silu_linear(self, gate_up, weight, residual=None, meta=None):
        return self.linear(self.ops.silu_mul(gate_up), weight, meta=meta, add=residual)

    def norm_mlp(self, x, residual, norm_weight, eps, gate_up_weight, down_weight, add_residual: bool = False,
                 meta=None):
        act, residual = self.norm_linear_silu(x, residual, norm_weight, eps, gate_up_weight, meta=meta)
        return self.linear(act, down_weight, meta=meta, add=residual if add_residual else None), residual

    def norm_linear_argmax(self, x, norm_weight, eps, weight, ids=None, out=None):
        if self.routes.reference:
            return None
        kernel = self.kernel_for("norm_head", x, weight, norm_weight=norm_weight)
        if kernel == "gemv":
            return self._draft.norm_linear_argmax(x, norm_weight, eps, weight, ids, out)
        return self._argmax_on(kernel, self.ops.rms_norm(x, norm_weight, eps), weight, ids)

    def linear_argmax(self, x, weight, ids=None):
        if self.routes.reference:
            return None
        kernel = self.kernel_for("head", x, weight)
        if kernel == "gemv":
            return self._draft.linear_argmax(x, weight, ids)
        return self._argmax_on(kernel, x, weight, ids)

    def norm_linear_top(self, x, norm_weight, eps, weight, n: int, ids=None):
        if self.routes.reference or not self._topk.supports(x.device, weight.shape[0], n):
            return None
        if self.kernel_for("norm_head", x, weight, norm_weight=norm_weight) == "gemv":
            logits = self._mods["gemv"].decode_norm_linear(x, norm_weight, eps, weight)[0]
        else:
            logits = linear(self.ops.rms_norm(x, norm_weight, eps), weight)
        return self._topk.top_rows(logits, n, ids)

    def masks_greedy(self, hidden) -> bool:
        """Whether a greedy guided step of these hidden states takes masked_argmax: not under the reference table
        (its steps sample from float32 logits), and where the argmax kernels run."""
        return not self.routes.reference and self._argmax.supports(hidden)

    def masked_argmax(self, logits, bitmask, forced=None):
        """A greedy guided step's tokens from its logits in the head's dtype, its grammar mask and its forced
        tokens (engine/kernels/sampling/argmax.py), without the float32 copy, the mask's fill and the sampler."""
        return self._argmax.masked_argmax(logits, bitmask, forced)

    def _argmax_on(self, kernel: str, x, weight, ids=None):
        """The argmax of x @ weight.T on head_mma (kernel "mma", where it takes x) or cuBLAS's logits."""
        if kernel == "mma" and self._mma.supports(x, weight):
            return self._mma.linear_argmax(x, weight, ids)
        logits = linear(x, weight)
        if self._argmax.supports(logits):
            return self._argmax.argmax_rows(logits, ids)
        rows = logits.float().argmax(-1)
        return rows if ids is None else ids[rows]

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping):
        self._k.store_kv(k, v, k_cache, v_cache, slot_mapping)

    def attend(self, q, k_cache, v_cache, meta, scale, rope=None):
        return self._k.paged_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
                                       scale, meta.max_query_len, max_seq_len=meta.max_seq_len, rope=rope,
                                       semaphores=self._semaphores, tree_masks=meta.tree_masks)

    def rope_attend(self, q, k, v, positions, rope_cache, k_cache, v_cache, meta, scale):
        if self._decode_attn is not None and meta.max_query_len == 1 and q.shape[0] <= meta.seq_lens.shape[0]:
            return self._decode_attn.decode_attention(
                q, k, v, positions, *rope_cache, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
                meta.slot_mapping, scale, num_splits=self._decode_splits, max_seq_len=meta.max_seq_len,
                semaphores=self._semaphores, prefetch_tiles=self._decode_prefetch)
        verify = self._verify_attn
        if verify is not None and verify.preferred(meta.seq_lens.shape[0]) and verify.supports(
                q.shape[1], k_cache.shape[2], meta.max_query_len, k_cache.shape[1]):
            return verify.verify_attention(
                q, k, v, positions, *rope_cache, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
                meta.slot_mapping, scale, meta.max_query_len, max_seq_len=meta.max_seq_len, semaphores=self._semaphores,
                tree_masks=meta.tree_masks)
        if self._rope_attention and self._k.fuses_rope(q.shape[1], k_cache.shape[2], meta.max_query_len,
                                                       k_cache.shape[1]):
            return self.attend(q, k_cache, v_cache, meta, scale, rope=(k, v, positions, *rope_cache, meta.slot_mapping))
        return super().rope_attend(q, k, v, positions, rope_cache, k_cache, v_cache, meta, scale)


def make_backend(name: str, **options):
    """The backend `name` ("torch" or "triton"); `options` (RoutedBackend's keywords) configure the routed one."""
    if name == "torch":
        return TorchBackend()
    if name == "triton":
        return RoutedBackend(**options)
    raise ValueError(f"unknown attention backend {name!r}")
