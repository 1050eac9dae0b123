"""The KV page budget: one pool of page ids for every cache the block tables index.

The target's KV cache, an EAGLE head's (one layer) and a draft model's each hold one page per block id, indexed
by the same block tables and slot mapping, so their pages come and go with a sequence's. A page therefore costs
the sum of their page sizes, and the number of pages is chosen for all of them together: a speculating engine
has fewer pages than a plain one on the same memory, never more memory than `kv_cache_memory_fraction` of what
is free.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class PagedCache:
    """One cache's shape per page: K and V of `layers` layers, `kv_heads` x `head_dim` per token."""
    name: str
    layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of_config(cls, name: str, cfg: dict) -> "PagedCache":
        """From a Llama-style config dict (HF config.json keys)."""
        heads = cfg["num_attention_heads"]
        return cls(name, cfg["num_hidden_layers"], cfg.get("num_key_value_heads", heads),
                   cfg.get("head_dim") or cfg["hidden_size"] // heads)

    def page_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        return 2 * self.layers * block_size * self.kv_heads * self.head_dim * torch.finfo(dtype).bits // 8


@dataclass(frozen=True)
class KVBudget:
    caches: tuple[PagedCache, ...]
    block_size: int
    dtype: torch.dtype

    @property
    def page_bytes(self) -> int:
        """Bytes one page id costs across every cache."""
        return sum(c.page_bytes(self.block_size, self.dtype) for c in self.caches)

    def pages_for_memory(self, free_bytes: int, fraction: float) -> int:
        """Pages that fit in `fraction` of `free_bytes` (at least one)."""
        return max(1, int(free_bytes * fraction) // self.page_bytes)


def kv_pages(layers: int, shape: tuple[int, ...], dtype: torch.dtype,
             device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed K and V arrays of `shape` for each of `layers` layers, views of one buffer (a draft tree moves an
    accepted leaf's keys in every layer at once: engine/speculative/tree.py kv_slab).

    On the CPU they are views of one buffer from the C allocator's zeroed allocation (numpy's zeros: calloc, an
    anonymous mapping at this size), whose pages the OS maps on first touch: a CPU engine sized for 8 sequences
    of 4K tokens (1.5 GB for the default model in float32) starts at once and holds only the pages its
    sequences write, where torch.zeros writes every byte before the first step."""
    device = torch.device(device)
    if device.type != "cpu":
        pages = torch.zeros((layers, 2, *shape), dtype=dtype, device=device)
        return [(pages[i, 0], pages[i, 1]) for i in range(layers)]
    count = 2 * layers * math.prod(shape)
    flat = torch.from_numpy(np.zeros(count * dtype.itemsize, dtype=np.uint8)).view(dtype)
    pages = flat.view(layers, 2, *shape)
    return [(pages[i, 0], pages[i, 1]) for i in range(layers)]
