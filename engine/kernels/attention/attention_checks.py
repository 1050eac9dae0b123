"""Argument checks of engine/kernels/attention/paged_attention.py's entry points: each raises ValueError naming
the problem."""
from __future__ import annotations

import torch

from engine.kernels.common import unit_stride

_INDEX_DTYPES = (torch.int32, torch.int64)


def check_cache(k_cache, v_cache):
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache/v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache dtype {k_cache.dtype} != v_cache dtype {v_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    block_size = k_cache.shape[1]
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")


def check_rows(name, x, cache, device):
    """x: [T, heads, head_dim] rows with unit stride in head_dim, on the cache's device."""
    if x.dim() != 3:
        raise ValueError(f"{name} must be [T, heads, head_dim], got shape {tuple(x.shape)}")
    if x.shape[2] != cache.shape[3]:
        raise ValueError(f"{name} head_dim {x.shape[2]} != cache head_dim {cache.shape[3]}")
    if x.stride(2) != 1:
        raise ValueError(f"{name} must have unit stride in head_dim")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, the cache on {device}")


def check_index(name, x, dim, device):
    if x.dim() != dim or x.dtype not in _INDEX_DTYPES or x.device != device:
        raise ValueError(f"{name} must be a {dim}-D int32/int64 tensor on {device}, "
                         f"got {x.dim()}-D {x.dtype} on {x.device}")
    if dim == 1:
        check_unit_stride(name, x)


def check_unit_stride(name, x):
    """A 1-D tensor the kernels read at entry i from offset i (no stride passed): a column view such as
    x[:, j] of a wider tensor would be misread."""
    if not unit_stride(x):
        raise ValueError(f"{name} must have unit stride, got stride {x.stride(0)}")


def check_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out):
    check_cache(k_cache, v_cache)
    dev = k_cache.device
    check_rows("q", q, k_cache, dev)
    if q.dtype != k_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} != cache dtype {k_cache.dtype}")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {k_cache.shape[2]}")
    check_index("cu_seqlens_q", cu_seqlens_q, 1, dev)
    check_index("seq_lens", seq_lens, 1, dev)
    check_index("block_tables", block_tables, 2, dev)
    b = seq_lens.shape[0]
    if cu_seqlens_q.shape[0] != b + 1 or block_tables.shape[0] != b:
        raise ValueError(f"batch mismatch: cu_seqlens_q {cu_seqlens_q.shape[0]} (want {b + 1}), "
                         f"block_tables {block_tables.shape[0]} (want {b})")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != dev
                            or out.stride(2) != 1):
        raise ValueError("out must match q's shape, dtype and device, with unit stride in head_dim")


def check_tree(tree_masks, max_query_len: int, device) -> None:
    """A draft tree's masks: int64 [n], one per new token of every sequence, at most 64 (bit j: new token j)."""
    if not isinstance(tree_masks, torch.Tensor) or tree_masks.dim() != 1 or tree_masks.dtype != torch.int64:
        raise ValueError("tree_masks must be an int64 tensor [n], one mask per new token of a sequence")
    check_unit_stride("tree_masks", tree_masks)
    if tree_masks.device != device:
        raise ValueError(f"tree_masks is on {tree_masks.device}, q on {device}")
    if not 1 <= tree_masks.shape[0] <= 64 or tree_masks.shape[0] < max_query_len:
        raise ValueError(f"tree_masks holds {tree_masks.shape[0]} masks: it needs one per new token (max_query_len "
                         f"{max_query_len}), at most 64")
