"""What a decode step must read, and the time that takes at a GPU's peak bandwidth: the roofline bench's floor
(bench/step/roofline.py), as pure functions of a model's config dict (HF config.json keys), so the CPU tests check
them against hand-counted shapes.

A decode step of a memory-bound model cannot take less than reading every weight once (each layer's matmuls and
norms, the LM head) and the K and V each stream attends over. What it writes (one token's KV a stream, activations)
and the embedding rows it gathers are a rounding error against those and are left out.
"""
from __future__ import annotations

import re

PEAK_GBPS = (            # (words that begin words of the GPU's name, GB/s); the first match counts
    (("H200",), 4800.0), (("H100", "PCIe"), 2000.0), (("H100", "SXM"), 3350.0), (("H100", "HBM3"), 3350.0),
    (("A100", "80GB", "PCIe"), 1935.0), (("A100", "80GB"), 2039.0), (("A100", "40GB"), 1555.0))
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def _dims(cfg: dict) -> tuple[int, int, int, int]:
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    return cfg["hidden_size"], heads, kv, cfg.get("head_dim") or cfg["hidden_size"] // heads


def weight_params(cfg: dict) -> int:
    """Parameters a decode step reads (a model config dict, HF keys): each layer's QKV (and its bias: Qwen2), o_proj,
    gate_up and down, its norms (and Qwen3's q/k norms), the final norm and the LM head, which is the embedding when
    tied. An untied embedding is left out: a step reads one of its rows a token."""
    h, heads, kv, d = _dims(cfg)
    q, k, inter = heads * d, kv * d, cfg["intermediate_size"]
    bias = cfg.get("attention_bias", cfg.get("model_type") == "qwen2")
    qkv = h * (q + 2 * k) + (q + 2 * k if bias else 0)
    norms = 2 * h + (2 * d if cfg.get("model_type") == "qwen3" else 0)
    layer = qkv + q * h + 3 * h * inter + norms
    return cfg["num_hidden_layers"] * layer + h + cfg["vocab_size"] * h


def param_count(cfg: dict) -> int:
    """All the model's parameters (an untied embedding too): what "a 1B model" counts."""
    untied = 0 if cfg.get("tie_word_embeddings", False) else cfg["vocab_size"] * cfg["hidden_size"]
    return weight_params(cfg) + untied


def kv_bytes(cfg: dict, streams: int, context: float, dtype_bytes: int) -> float:
    """KV bytes a decode step reads: K and V of `context` tokens a stream, every layer."""
    _, _, kv, d = _dims(cfg)
    return streams * cfg["num_hidden_layers"] * context * 2 * kv * d * dtype_bytes


def floor_bytes(cfg: dict, streams: int, context: float, dtype_bytes: int) -> float:
    """Bytes one decode step of `streams` rows at `context` tokens must read: the weights once, every row's KV."""
    return weight_params(cfg) * dtype_bytes + kv_bytes(cfg, streams, context, dtype_bytes)


def peak_gbps(name: str, override: float | None = None) -> float:
    """The GPU's peak memory bandwidth in GB/s: `override`, else PEAK_GBPS's first entry each of whose words begins
    a word of `name` (words split at spaces and dashes: "NVIDIA A100-SXM4-80GB"; a GH200 is no H200)."""
    if override is not None:
        return override
    parts = re.split(r"[\s_-]+", name.lower())
    for words, gbps in PEAK_GBPS:
        if all(any(p.startswith(w.lower()) for p in parts) for w in words):
            return gbps
    known = ", ".join(" ".join(w) for w, _ in PEAK_GBPS)
    raise ValueError(f"no peak bandwidth known for {name!r} (known: {known}); give --peak-gbps")
