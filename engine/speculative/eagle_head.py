"""An EAGLE-3-style draft head for a Llama-family target (Li et al. 2025, arXiv 2503.01840).

The head sees, at position t, the target's hidden states from three layers (low, middle, high), fused
by `fc` into one H-wide feature, and the embedding of token t+1; one Llama decoder layer with input
width 2H turns them into a hidden state. The target's final norm and LM head turn that hidden state into
the distribution of token t+2. The embedding, final norm and LM head are the target's (frozen, not stored
with the head). Drafting K tokens feeds the head its own hidden state in place of the fused feature
from the second draft on; training unrolls the same thing (`unrolled_logits`, EAGLE-3's training-time test).

This file holds the weights and the dense (training / offline evaluation) forward. The in-engine forward
over paged KV (engine/speculative/eagle_paged.py) computes the same layer with the norm weights folded into the matmuls;
tests/speculative/test_spec_eagle.py checks that its drafts equal `unrolled_logits`'.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    feature_layers: tuple[int, int, int]     # target layers whose outputs are fused (low, middle, high)

    @classmethod
    def for_target(cls, cfg: dict) -> "HeadConfig":
        """From a Llama-style config dict (HF config.json keys), layers as SpecForge picks them. The MLP is
        two thirds of the target's width (multiple of 64): SmolLM2-135M's head then ships in 8.4 MB."""
        n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        inter = max(64, cfg["intermediate_size"] * 2 // 3 // 64 * 64)
        return cls(h, inter, heads, cfg.get("num_key_value_heads", heads),
                   cfg.get("head_dim") or h // heads, cfg.get("rms_norm_eps", 1e-5), cfg.get("rope_theta", 10000.0),
                   (min(1, n - 1), max(n // 2 - 1, 0), max(n - 4, 0)))

    def to_dict(self) -> dict:
        return asdict(self)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half layout) of x [..., T, heads, head_dim] at positions [..., T]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = positions.float()[..., None] * inv                          # [..., T, d/2]
    cos, sin = ang.cos()[..., None, :], ang.sin()[..., None, :]
    x1, x2 = x.float()[..., :d // 2], x.float()[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class EagleHead(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.cfg = cfg
        h, i = cfg.hidden_size, cfg.intermediate_size
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.input_norms = nn.Parameter(torch.ones(3, h))    # one RMSNorm per fused target layer
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.embed_norm = nn.Parameter(torch.ones(h))
        self.feature_norm = nn.Parameter(torch.ones(h))
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(2 * h, n, bias=False) for n in (q, kv, kv))
        self.o_proj = nn.Linear(q, h, bias=False)
        self.post_norm = nn.Parameter(torch.ones(h))
        self.gate_proj, self.up_proj = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """[..., 3H] target hidden states (low, middle, high, concatenated) -> [..., H]. Each is RMS-normed
        first: SmolLM2's hidden states carry outliers of ~25,000 next to a mean of ~9, which would swamp the
        head's residual stream (and round away its updates in bfloat16)."""
        parts = features.unflatten(-1, (3, -1))
        return self.fc(rms_norm(parts, self.input_norms, self.cfg.rms_norm_eps).flatten(-2))

    def layer_inputs(self, feature: torch.Tensor, embeds: torch.Tensor):
        """Query / key / value of the decoder layer, [..., heads, head_dim] each, from feature and embedding."""
        c = self.cfg
        x = torch.cat([rms_norm(embeds, self.embed_norm, c.rms_norm_eps),
                       rms_norm(feature, self.feature_norm, c.rms_norm_eps)], dim=-1)
        shape = x.shape[:-1]
        return (self.q_proj(x).view(*shape, c.num_heads, c.head_dim),
                self.k_proj(x).view(*shape, c.num_kv_heads, c.head_dim),
                self.v_proj(x).view(*shape, c.num_kv_heads, c.head_dim))

    def mlp_out(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Attention output [..., heads * head_dim] -> the layer's hidden state [..., H]."""
        h = residual + self.o_proj(attn)
        x = rms_norm(h, self.post_norm, self.cfg.rms_norm_eps)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def new_head(target_config: dict, dtype, device, seed: int = 0) -> EagleHead:
    """An untrained head for the target, the same for the same seed (the global RNG is left as it was): the
    start of training, and `spec_head="random"` (drafts rarely accepted: tests of the machinery)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = EagleHead(HeadConfig.for_target(target_config))
    return head.to(device=device, dtype=dtype)


def unrolled_logits(head: EagleHead, features, embed, tokens, final_norm, lm_head, depth: int, select=None):
    """EAGLE-3's training-time test over a batch of whole sequences.

    features [B, T, 3H]: the target's hidden states at each position; tokens [B, T]; embed / final_norm /
    lm_head: the target's (callables). Step 0 reads the target feature at t and the embedding of token t+1
    and predicts token t+2; step i >= 1 reads step i-1's own hidden state at t and the embedding of token
    t+1+i, sits at position t+i, attends to step 0's keys at positions <= t and to its own earlier steps'
    keys at t (what drafting sees), and predicts token t+2+i. Returns [logits_i [B, T, V] for i < depth]:
    entries whose target lies past the sequence are meaningless (mask them in the loss)."""
    c = head.cfg
    b, t, _ = features.shape
    pos = torch.arange(t, device=features.device)
    feature = head.fuse(features)
    nxt = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)
    group = c.num_heads // c.num_kv_heads
    scale = 1.0 / math.sqrt(c.head_dim)
    causal = pos[None, :] <= pos[:, None]                                     # [T(query), T(key)]
    keys, values, logits = [], [], []
    for i in range(depth):
        emb = embed(torch.cat([nxt[:, i:], nxt[:, -1:].expand(b, i)], dim=1))
        q, k, v = head.layer_inputs(feature, emb)
        q, k = rope(q, pos + i, c.rope_theta), rope(k, pos + i, c.rope_theta)
        keys.append(k.repeat_interleave(group, dim=2))
        values.append(v.repeat_interleave(group, dim=2))
        scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), keys[0].float()) * scale
        scores = scores.masked_fill(~causal, float("-inf"))
        diag = [torch.einsum("bqhd,bqhd->bhq", q.float(), km.float())[..., None] * scale for km in keys[1:]]
        probs = torch.cat([scores, *diag], dim=-1).softmax(-1)
        out = torch.einsum("bhqk,bkhd->bqhd", probs[..., :t], values[0].float())
        for m, vm in enumerate(values[1:]):
            out = out + probs[..., t + m].permute(0, 2, 1)[..., None] * vm.float()
        hidden = head.mlp_out(out.to(feature.dtype).flatten(2), feature)
        logits.append(lm_head(final_norm(hidden if select is None else hidden[select])))
        feature = hidden
    return logits
