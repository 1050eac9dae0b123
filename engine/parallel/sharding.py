"""Which part of each weight a rank holds (Megatron-style), and how to cut it from the full tensor.

Columns of QKV and gate/up (by KV-head groups and by intermediate units), rows of o_proj and down_proj, and
the vocabulary of the embedding and the LM head. Every rank holds the norms whole. Head counts that do not
divide by the rank count are split as evenly as whole KV-head groups allow (SmolLM2-135M's 3 KV heads over 2
ranks: 2 and 1); a rank's query heads are those of its KV heads. The vocabulary is split in equal, padded
parts (an all-gather needs equal sizes); padding rows are zeros and their logits are cut off.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def split(n: int, rank: int, world: int) -> tuple[int, int]:
    """[start, stop) of rank's part of n units; sizes differ by at most one (the first ranks get more)."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def attention_heads(num_heads: int, num_kv_heads: int, rank: int, world: int):
    """((first, stop) query heads, (first, stop) KV heads) of a rank."""
    if num_kv_heads < world:
        raise ValueError(f"tensor_parallel_size {world} exceeds the model's {num_kv_heads} KV heads: every rank "
                         f"needs at least one")
    group = num_heads // num_kv_heads
    kv = split(num_kv_heads, rank, world)
    return (kv[0] * group, kv[1] * group), kv


def vocab_rows(vocab: int, rank: int, world: int) -> tuple[int, int, int]:
    """(first, stop) vocabulary ids of a rank and its padded row count (the same on every rank)."""
    rows = -(-vocab // world)
    start = min(vocab, rank * rows)
    return start, min(vocab, start + rows), rows


@dataclass(frozen=True)
class ParamShard:
    """A weight cut along `dim`: the full tensor is `parts` side by side ((size, start, stop) each, e.g. the
    q, k and v projections of a fused QKV), and a rank holds [start, stop) of every part, in order; `rows`
    pads the local tensor along `dim` with zeros (the vocabulary)."""
    dim: int
    parts: tuple[tuple[int, int, int], ...]
    rows: int = 0

    def full_shape(self, local: torch.Size) -> tuple[int, ...]:
        shape = list(local)
        shape[self.dim] = sum(size for size, _, _ in self.parts)
        return tuple(shape)

    def offset(self, part: int) -> int:
        """Where part `part` starts in the local tensor."""
        return sum(stop - start for _, start, stop in self.parts[:part])

    def take(self, full: torch.Tensor, local: torch.Tensor) -> None:
        """Copy this rank's part of `full` into `local` (zeros in the padding)."""
        base = 0
        local.zero_()
        for i, (size, start, stop) in enumerate(self.parts):
            local.narrow(self.dim, self.offset(i), stop - start).copy_(
                full.narrow(self.dim, base + start, stop - start))
            base += size


def param_shards(cfg: dict, rank: int, world: int) -> dict[str, ParamShard]:
    """Engine parameter name -> how it is cut; parameters not named are whole on every rank (and with one
    rank nothing is cut)."""
    if world == 1:
        return {}
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim") or cfg["hidden_size"] // heads
    (qa, qb), (ka, kb) = attention_heads(heads, kv_heads, rank, world)
    q, kv = (heads * d, qa * d, qb * d), (kv_heads * d, ka * d, kb * d)
    inter = cfg["intermediate_size"]
    mlp = (inter, *split(inter, rank, world))
    va, vb, rows = vocab_rows(cfg["vocab_size"], rank, world)
    out = {"embed_tokens.weight": ParamShard(0, ((cfg["vocab_size"], va, vb),), rows)}
    if not cfg.get("tie_word_embeddings", False):
        out["lm_head.weight"] = out["embed_tokens.weight"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        out[p + "self_attn.qkv_proj.weight"] = out[p + "self_attn.qkv_proj.bias"] = ParamShard(0, (q, kv, kv))
        out[p + "self_attn.o_proj.weight"] = ParamShard(1, (q,))
        out[p + "mlp.gate_up_proj.weight"] = ParamShard(0, (mlp, mlp))
        out[p + "mlp.down_proj.weight"] = ParamShard(1, (mlp,))
    return out
