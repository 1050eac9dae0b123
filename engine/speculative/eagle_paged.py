"""The draft head as the engine runs it: one decoder layer over its own paged KV cache, inside the step.

The head's cache has the target's page layout and is indexed by the same block tables and slot mapping, so a
sequence's pages hold the target's KV of every layer and the head's of its one; they come and go together.

Position t of the head's cache holds the key of "the head at t": the fused target feature at t and the
embedding of token t + 1 (what `unrolled_logits` calls step 0). `write_kv` writes it for every token of a
step (prompt chunks included) once the step's tokens are known. A draft from position t then runs single-token
layers: step 0 queries at t and predicts token t + 2; draft step i >= 1 sits at position t + i, takes the
previous hidden state as its feature and the previous draft's embedding, writes its key there, and predicts
token t + 2 + i. Those draft keys are overwritten by `write_kv` of the next steps before anything reads
them as step-0 keys: a step rewrites every position from its first input on, and a query reads only
positions up to its own.
"""
from __future__ import annotations

import json
from pathlib import Path
import torch

from engine.attention import AttentionMetadata
from engine.kernels.matmul.cpu_gemm import linear
from engine.kernels.routes import Site
from engine.memory.kv_cache import kv_pages
from engine.models.llama import rope_inv_freq, rope_tables
from engine.speculative.eagle_head import EagleHead, HeadConfig
from engine.speculative.prompt_vocab import PromptVocab

# The shipped heads live with the training code that writes them (`specdec.train_head --ship`); the engine only
# reads them as files, found beside the engine package (repository root, or site-packages), never by importing specdec.
HEADS = Path(__file__).resolve().parents[2] / "specdec" / "heads"


def head_config(path: str | Path) -> HeadConfig:
    """A head directory's head.json (its shape, without its weights)."""
    path = Path(path)
    if not (path / "head.json").is_file():
        raise FileNotFoundError(f"draft head directory {path} has no head.json")
    raw = json.loads((path / "head.json").read_text())
    fields = {k: raw[k] for k in HeadConfig.__dataclass_fields__}
    fields["feature_layers"] = tuple(fields["feature_layers"])
    return HeadConfig(**fields)


def load_head(path: str | Path, dtype: torch.dtype, device: torch.device) -> EagleHead:
    """A head directory (head.json + head.safetensors, as `specdec.train_head --stage export` writes it)."""
    from safetensors.torch import load_file
    path = Path(path)
    cfg = head_config(path)
    if not (path / "head.safetensors").is_file():
        raise FileNotFoundError(f"draft head directory {path} has no head.safetensors")
    head = EagleHead(cfg)
    head.load_state_dict(load_file(str(path / "head.safetensors")))
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)


def check_head(head: EagleHead, target_config: dict) -> None:
    """A head drafts for a target only if its widths and feature layers fit it."""
    c, h, n = head.cfg, target_config["hidden_size"], target_config["num_hidden_layers"]
    if c.hidden_size != h:
        raise ValueError(f"draft head hidden size {c.hidden_size} != the model's {h}")
    if max(c.feature_layers) >= n:
        raise ValueError(f"draft head reads layers {c.feature_layers}, the model has {n}")


class PagedHead:
    def __init__(self, head: EagleHead, target, backend, num_blocks: int, block_size: int, max_positions: int):
        c = head.cfg
        self.head, self.cfg, self.target, self.backend = head, c, target, backend
        self.ops = backend.ops
        w = head.fc.weight
        # Each input RMSNorm's weight is folded into the matmul after it: the norms then run with unit weights,
        # all pieces of one input in one kernel (fewer small kernels in every step)
        self.fc_weight = w * head.input_norms.flatten()[None, :]
        self.qkv_weight = torch.cat([head.q_proj.weight, head.k_proj.weight, head.v_proj.weight]) \
            * torch.cat([head.embed_norm, head.feature_norm])[None, :]
        self.unit = torch.ones_like(head.embed_norm)
        self.gate_up_weight = torch.cat([head.gate_proj.weight, head.up_proj.weight])
        self.sizes = [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        shape = (num_blocks, block_size, c.num_kv_heads, c.head_dim)
        [(self.k_cache, self.v_cache)] = kv_pages(1, shape, w.dtype, w.device)
        self.cos, self.sin = rope_tables(rope_inv_freq({"rope_theta": c.rope_theta}, c.head_dim), max_positions,
                                         w.device)
        self.scale = c.head_dim ** -0.5
        self.draft_ids = self.draft_weight = None       # restrict(): a draft vocabulary
        self.prompt_vocab = None                        # ... and its spare rows for prompts' tokens
        # the embedding, both norms and their stack in one kernel (engine/kernels/speculative/head_ops.py) on the fused
        # path with the whole vocabulary here (one rank)
        self._pair_norm = None
        if backend.fused and target.tp.world == 1:
            from engine.kernels.speculative import head_ops
            self._pair_norm = head_ops.embed_pair_norm

    def _unit_norm(self, x, parts: int):
        """RMS-norm each of the `parts` H-wide pieces of x [N, parts * H] (unit weight)."""
        return self.ops.rms_norm(x.reshape(-1, self.cfg.hidden_size), self.unit, self.cfg.rms_norm_eps).view(
            -1, parts * self.cfg.hidden_size)

    def _inputs(self, feature, next_ids):
        """Normed [embedding of the next token, feature] -> fused q / k / v [N, heads, head_dim]."""
        c = self.cfg
        if self._pair_norm is not None:
            x = self._pair_norm(next_ids, self.target.embed_tokens.weight, feature.to(self.unit.dtype), self.unit,
                                c.rms_norm_eps)
        else:
            x = self._unit_norm(torch.stack([self.target.embed_tokens(next_ids), feature.to(self.unit.dtype)], 1), 2)
        q, k, v = self.backend.linear(x, self.qkv_weight).split(self.sizes, dim=-1)
        return (q.view(-1, c.num_heads, c.head_dim), k.view(-1, c.num_kv_heads, c.head_dim),
                v.view(-1, c.num_kv_heads, c.head_dim))

    def write_kv(self, features, next_ids, positions, slot_mapping):
        """Step-0 keys of a step's tokens (features [T, 3H] from the target's forward) into the head's cache.
        Returns (rotated queries [T, heads, head_dim], fused features [T, H]) for the rows that draft."""
        feature = self.backend.linear(self._unit_norm(features.to(self.unit.dtype), 3), self.fc_weight)
        q, k, v = self._inputs(feature, next_ids)
        return self._rope_store(q, k, v, positions, slot_mapping), feature

    def _rope_store(self, q, k, v, positions, slot_mapping):
        return self.ops.rope_store_kv(q, k, v, positions, self.cos, self.sin, self.k_cache, self.v_cache, slot_mapping)

    def attend(self, q, meta: AttentionMetadata, residual):
        """The layer's output [N, H] for queries q [N, heads, head_dim] (one per sequence of `meta`)."""
        return self._finish(self.backend.attend(q.contiguous(), self.k_cache, self.v_cache, meta, self.scale),
                            residual)

    def _finish(self, out, residual):
        """o_proj, the residual, the post-attention norm and the MLP on the attention output [N, heads, head_dim]."""
        h = self.head
        o = self.backend.linear(out.flatten(1), h.o_proj.weight)
        return self.backend.norm_mlp(o, residual, h.post_norm, self.cfg.rms_norm_eps, self.gate_up_weight,
                                     h.down_proj.weight, add_residual=True)[0]

    def step(self, hidden, token, positions, meta: AttentionMetadata):
        """Draft step i >= 1: the previous hidden state and draft token at `positions` (one per sequence)."""
        q, k, v = self._inputs(hidden, token)
        out = self.backend.rope_attend(q, k, v, positions, (self.cos, self.sin), self.k_cache, self.v_cache, meta,
                                       self.scale)
        return self._finish(out, hidden)

    def logits(self, hidden):
        """The target's final norm and LM head on the head's hidden states -> float logits [N, V]."""
        return self.target.compute_logits(self.target.final_norm(hidden, self.backend))

    def restrict(self, token_ids, spare=()) -> None:
        """Drafts from these token ids only (Tuning.spec_draft_vocab): their rows of the LM head are gathered
        once, so a draft step reads len(token_ids) rows instead of the vocabulary. `spare`: ids of rows after them
        that recent prompts' tokens take (engine/speculative/prompt_vocab.py). Drafts under the grammar's draft
        masks keep the whole vocabulary (the mask is over it); so does a target split over ranks."""
        ranked = torch.as_tensor(token_ids, dtype=torch.int64)
        if ranked.dim() != 1 or ranked.numel() == 0:
            raise ValueError("the draft vocabulary must be a non-empty list of token ids")
        ids = torch.cat([ranked, torch.as_tensor(list(spare), dtype=torch.int64)])
        vocab = self.target.vocab
        if ids.min() < 0 or ids.max() >= vocab or ids.unique().numel() != ids.numel():
            raise ValueError(f"the draft vocabulary's ids must be distinct, in [0, {vocab})")
        if self.target.tp.world == 1:
            ids = ids.to(self.target.head_weight.device)
            self.draft_ids, self.draft_weight = ids, self.target.head_weight[ids].contiguous()
            self.prompt_vocab = PromptVocab(ranked.tolist(), list(spare), vocab) if len(spare) else None

    def write_vocab(self, writes: dict[int, int]) -> None:
        """Spare rows take new ids ({row: id}, from PromptVocab.admit), on the current stream: the steps enqueued
        before it draft from the old ids, those after it from the new."""
        pairs = torch.tensor([list(writes), list(writes.values())], dtype=torch.int64,
                             pin_memory=self.draft_ids.is_cuda)
        rows, ids = pairs.to(self.draft_ids.device, non_blocking=True)
        self.draft_ids.index_copy_(0, rows, ids)
        self.draft_weight.index_copy_(0, rows, self.target.head_weight.index_select(0, ids))

    def route_sites(self) -> list[Site]:
        """The head's matmuls and its draft LM head (with the final norm), for the route table."""
        h, t = self.head, self.target
        sites = [Site("linear", [self.fc_weight]), Site("linear", [self.qkv_weight]), Site("linear", [h.o_proj.weight]),
                 Site("norm_linear_silu", [self.gate_up_weight], h.post_norm), Site("linear", [h.down_proj.weight])]
        if t.tp.world == 1:     # drafts under draft masks read the whole vocabulary, others the draft rows
            heads = [t.head_weight] + ([] if self.draft_weight is None else [self.draft_weight])
            sites += [Site("norm_head", [w], t.norm.weight) for w in heads]
        return sites

    def top(self, hidden, n: int):
        """The n tokens of the highest logits under the target's final norm and LM head (over the draft
        vocabulary where it has one), best first: int64 [N, n]."""
        t = self.target
        if t.tp.world == 1:         # the backend's kernels, where it has them (as `greedy`)
            weight, ids = (t.head_weight, None) if self.draft_ids is None else (self.draft_weight, self.draft_ids)
            tokens = self.backend.norm_linear_top(hidden, t.norm.weight, t.norm.eps, weight, n, ids)
            if tokens is not None:
                return tokens
        if self.draft_ids is None:
            return self.logits(hidden).topk(n, dim=-1).indices
        logits = linear(t.final_norm(hidden, self.backend), self.draft_weight).float()
        return self.draft_ids[logits.topk(n, dim=-1).indices]

    def greedy(self, hidden, out=None):
        """logits(hidden).argmax(-1) in the backend's norm + LM head + argmax kernels (int64 [N]), or None where it
        has none for the call. A target split over ranks keeps the logits: its vocabulary is gathered. With a
        draft vocabulary, the argmax over its rows (by kernels or torch), as a token id (the kernels map it).
        The kernels may write into `out` (int64 [N], unit stride); the result may also be another tensor."""
        t = self.target
        if t.tp.world > 1:
            return None
        if self.draft_ids is None:
            return self.backend.norm_linear_argmax(hidden, t.norm.weight, t.norm.eps, t.head_weight, out=out)
        tokens = self.backend.norm_linear_argmax(hidden, t.norm.weight, t.norm.eps, self.draft_weight,
                                                 ids=self.draft_ids, out=out)
        if tokens is None:
            tokens = self.draft_ids[linear(t.final_norm(hidden, self.backend), self.draft_weight).float().argmax(-1)]
        return tokens
