"""The engine's Llama-family forward (Llama, SmolLM, Qwen2/3, Mistral) over a paged KV cache.

Tokens of all sequences in a step are flattened to [T, hidden]; attention metadata says where each
sequence's new tokens and pages are. QKV and gate/up projections are fused into one matmul each.

Two paths with the same math: the reference path (torch ops, the `torch` attention backend; in float32
it equals Hugging Face transformers) and the fused path (`backend.fused`: Triton kernels for residual
add + RMSNorm, RoPE + KV store and SiLU * up; in decode and verification steps RoPE + KV store run inside the
attention kernel, so a decode layer is ~8 kernels). The fused path's matmuls run on the kernel the route table
measured fastest at the step's rows (engine/kernels/routes.py): the decode GEMV or decode_gemm, with the norm and
SiLU * up folded in (5 kernels a layer, launched dependently: docs/decode_step.md), or cuBLAS. Both paths compute
RoPE and SiLU * up in float32 and round once, so in bf16 they differ only in summation order
(engine/kernels/fused_ops.py).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata
from engine.kernels.matmul.cpu_gemm import Linear, linear
from engine.kernels.routes import Site
from engine.models.loader import rope_type
from engine.parallel.group import SINGLE
from engine.parallel.sharding import attention_heads, split, vocab_rows


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(cfg: dict, head_dim: int) -> torch.Tensor:
    theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = rope_type(cfg)
    if kind == "llama3":
        inv = _llama3_scale(inv, cfg.get("rope_scaling") or cfg["rope_parameters"])
    elif kind != "default":
        raise ValueError(f"rope type {kind!r} is not supported")
    return inv


def rope_tables(inv: torch.Tensor, max_positions: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos / sin [max_positions, head_dim] for the rotate-half layout (apply_rope, rope_store_kv)."""
    freqs = torch.outer(torch.arange(max_positions, device=device).float(), inv.to(device))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _llama3_scale(inv: torch.Tensor, s: dict) -> torch.Tensor:
    factor, lo, hi = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(is_mid, mid, scaled)


def apply_rope(x, cos, sin):
    """x: [T, H, D]; cos/sin: [T, D] float32. HF's rotate_half convention, computed in float32 and rounded
    once (as the fused kernel does; in float32 this is exactly HF's math)."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


class Attention(nn.Module):
    """This rank's heads (all of them with one rank): QKV by columns, o_proj by rows (its sum over ranks is
    the layer's output, all-reduced by the caller)."""

    def __init__(self, cfg: dict, layer_idx: int, tp=SINGLE):
        super().__init__()
        heads = cfg["num_attention_heads"]
        (qa, qb), (ka, kb) = attention_heads(heads, cfg.get("num_key_value_heads", heads), tp.rank, tp.world)
        self.num_heads, self.num_kv_heads = qb - qa, kb - ka
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = bool(cfg.get("attention_bias", cfg["model_type"] == "qwen2"))
        self.qkv_proj = Linear(cfg["hidden_size"], self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, cfg["hidden_size"], bias=False)
        self.qk_norm = cfg["model_type"] == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg["rms_norm_eps"])
            self.k_norm = RMSNorm(self.head_dim, cfg["rms_norm_eps"])
        self.scale = self.head_dim ** -0.5
        self.layer_idx = layer_idx

    def _qkv(self, qkv):
        """[T, heads, head_dim] views of the fused projection's output (q/k normed for Qwen3)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(self, x, cos, sin, meta: AttentionMetadata, kv_cache, backend):
        q, k, v = self._qkv(self.qkv_proj(x))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache, v_cache = kv_cache
        backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = backend.attend(q.contiguous(), k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))

    def forward_fused(self, qkv, positions, rope_cache, meta: AttentionMetadata, kv_cache, backend):
        """From the fused QKV projection's output to o_proj's."""
        q, k, v = self._qkv(qkv)
        out = backend.rope_attend(q, k, v, positions, rope_cache, *kv_cache, meta, self.scale).view(-1, self.q_size)
        return backend.linear(out, self.o_proj.weight, meta=meta)


class MLP(nn.Module):
    def __init__(self, cfg: dict, tp=SINGLE):
        super().__init__()
        start, stop = split(cfg["intermediate_size"], tp.rank, tp.world)
        self.inter = stop - start
        self.gate_up_proj = Linear(cfg["hidden_size"], 2 * self.inter, bias=False)
        self.down_proj = Linear(self.inter, cfg["hidden_size"], bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj((F.silu(gate.float()) * up.float()).to(x.dtype))  # fp32, rounded once


class DecoderLayer(nn.Module):
    def __init__(self, cfg: dict, layer_idx: int, tp=SINGLE):
        super().__init__()
        self.tp = tp                    # attention and MLP outputs are partial sums over ranks: all-reduced
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.self_attn = Attention(cfg, layer_idx, tp)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.mlp = MLP(cfg, tp)

    def forward(self, x, cos, sin, meta, kv_cache, backend):
        x = x + self.tp.all_reduce(self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache, backend))
        return x + self.tp.all_reduce(self.mlp(self.post_attention_layernorm(x)))

    def forward_fused(self, h, residual, positions, rope_cache, meta, kv_cache, backend):
        """h: the previous layer's output, not yet added to `residual` (None at the first layer). Returns this
        layer's (h, residual) likewise, and its input: h + residual as given (the previous layer's output), which
        the input norm's kernel writes anyway."""
        attn, mlp = self.self_attn, self.mlp
        qkv, layer_input = _norm_proj(h, residual, self.input_layernorm, attn.qkv_proj, backend, meta)
        h = self.tp.all_reduce(attn.forward_fused(qkv, positions, rope_cache, meta, kv_cache, backend))
        norm = self.post_attention_layernorm
        out, residual = backend.norm_mlp(h, layer_input, norm.weight, norm.eps, mlp.gate_up_proj.weight,
                                         mlp.down_proj.weight, meta=meta)
        return self.tp.all_reduce(out), residual, layer_input


def _norm_proj(h, residual, norm: RMSNorm, proj: Linear, backend, meta=None):
    """proj(rms_norm(h + residual)) and the new residual (h itself when there is none yet)."""
    return backend.norm_linear(h, residual, norm.weight, norm.eps, proj.weight, proj.bias, meta=meta)


class VocabEmbedding(nn.Module):
    """The embedding of this rank's vocabulary rows; ids outside them embed to zeros, and the all-reduce
    over ranks completes every row (one rank: a plain lookup)."""

    def __init__(self, vocab: int, hidden: int, tp=SINGLE):
        super().__init__()
        self.tp = tp
        self.start, self.stop, rows = vocab_rows(vocab, tp.rank, tp.world)
        self.weight = nn.Parameter(torch.empty(rows, hidden))

    def forward(self, ids):
        if self.tp.world == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (ids < self.stop)
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * inside[:, None].to(self.weight.dtype)
        return self.tp.all_reduce(x)


def _in_order(outputs: dict, layers) -> torch.Tensor:
    """The requested layers' outputs concatenated in the order asked, a layer asked twice given twice (a small
    target's head may read one layer for two of its inputs), as HF's hidden_states[i + 1] are indexed."""
    return torch.cat([outputs[i] for i in layers], dim=-1)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: dict, tp=SINGLE):
        super().__init__()
        self.cfg, self.tp, self.vocab = cfg, tp, cfg["vocab_size"]
        self.embed_tokens = VocabEmbedding(cfg["vocab_size"], cfg["hidden_size"], tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        if not self.tied:
            self.lm_head = Linear(cfg["hidden_size"], self.embed_tokens.weight.shape[0], bias=False)

    def init_rope(self, max_positions: int, device) -> None:
        """Built after the weights land (the module may have been created on the meta device)."""
        self.cos_cache, self.sin_cache = rope_tables(rope_inv_freq(self.cfg, self.layers[0].self_attn.head_dim),
                                                     max_positions, device)

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches, backend, aux_layers=(), embeds=None):
        """Final hidden states [T, hidden]; with aux_layers, also the outputs of those layers (the residual
        stream after each, HF's hidden_states[i + 1]) concatenated to [T, len(aux_layers) * hidden], for a
        draft head (engine/speculative/eagle_paged.py). embeds: input_ids' embedding rows, looked up already."""
        if backend.fused:
            return self._forward_fused(input_ids, positions, meta, kv_caches, backend, aux_layers, embeds)
        x, aux = self.embed_tokens(input_ids) if embeds is None else embeds, {}
        cos, sin = self.cos_cache[positions], self.sin_cache[positions]
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            x = layer(x, cos, sin, meta, kv, backend)
            if i in aux_layers:
                aux[i] = x
        return (self.norm(x), _in_order(aux, aux_layers)) if aux_layers else self.norm(x)

    def _forward_fused(self, input_ids, positions, meta, kv_caches, backend, aux_layers=(), embeds=None):
        h, residual, aux = self.embed_tokens(input_ids) if embeds is None else embeds, None, {}
        stack = backend.decode_stack(self, h, meta, aux_layers)
        if stack is not None:           # the whole stack in one launch (it overwrites h, a new tensor of the step's)
            return stack(h, positions, meta, aux=bool(aux_layers))
        rope_cache = (self.cos_cache, self.sin_cache)
        # a layer's output (h + residual) is the next one's input, and the final norm's: taken from there, no add
        # (and only the asked layers' kept: the others' memory goes back as the forward moves on)
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            h, residual, layer_input = layer.forward_fused(h, residual, positions, rope_cache, meta, kv, backend)
            if i - 1 in aux_layers:
                aux[i - 1] = layer_input
        h, last = backend.ops.rms_norm(h, self.norm.weight, self.norm.eps, residual)
        if len(self.layers) - 1 in aux_layers:
            aux[len(self.layers) - 1] = last
        return (h, _in_order(aux, aux_layers)) if aux_layers else h

    def route_sites(self) -> list[Site]:
        """The matmuls whose kernel the route table chooses (engine/kernels/routes.py): a biased QKV (Qwen2) is
        cuBLAS's alone."""
        attn, mlp = [layer.self_attn for layer in self.layers], [layer.mlp for layer in self.layers]
        first = self.layers[0]
        sites = [] if attn[0].qkv_proj.bias is not None else [
            Site("norm_linear", [a.qkv_proj.weight for a in attn], first.input_layernorm.weight)]
        return sites + [Site("linear", [a.o_proj.weight for a in attn]),
                        Site("norm_linear_silu", [m.gate_up_proj.weight for m in mlp],
                             first.post_attention_layernorm.weight),
                        Site("linear", [m.down_proj.weight for m in mlp]),
                        Site("head", [self.head_weight])]

    def final_norm(self, x, backend):
        return backend.ops.rms_norm(x, self.norm.weight, self.norm.eps) if backend.fused else self.norm(x)

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head's weight (this rank's vocabulary rows): the embedding's when tied."""
        return self.embed_tokens.weight if self.tied else self.lm_head.weight

    def compute_logits(self, hidden, float32: bool = True):
        """Logits [N, V], float32 unless `float32` is False (then the dtype's, for the argmax kernels, whose
        answer is the same); with several ranks each computes its vocabulary rows and all gather them."""
        logits = linear(hidden, self.head_weight)
        if self.tp.world > 1:
            logits = self.tp.gather_vocab(logits)
            if logits.shape[1] != self.vocab:                  # padding rows of the last rank
                logits = logits[:, :self.vocab].contiguous()
        return logits.float() if float32 else logits
