"""Drafting with a smaller model of the Llama family that shares the target's tokenizer (vocabulary).

The draft model keeps its own paged KV cache with the target's page layout, indexed by the same block tables
and slot mapping, so its pages come and go with the sequence's. Every step it runs over the step's inputs
at their (corrected) positions and writes its KV for them, as the target does. A row that drafts then runs K
single-token forwards: the first from the token the step emitted after its last verified input t (at t + 1),
each next one from the previous draft (forward j at position t + 1 + j); each argmax is the next draft
(under the row's grammar in a guided step: FeatureContext.pick). Drafts are greedy (verified as one-hot proposals), so
rejection sampling stays lossless.

Keys written past the step's inputs (the draft forwards') are rewritten by the next steps before anything
reads them as a verified token's: a step rewrites every position from its first input on. The scheduler
reserves K tokens of pages ahead when it can (`lookahead`); a write past a sequence's pages is dropped.
"""
from __future__ import annotations

import torch

from engine.memory.kv_cache import kv_pages
from engine.speculative.drafters.base import Drafter, FeatureContext, Proposal, draft_layout


def draft_source(config, target_source):
    """The draft model's ModelSource; its vocabulary must be the target's (drafts are target token ids)."""
    from engine.models.loader import resolve_model
    if not config.spec_draft_model:
        raise ValueError("speculative='draft_model' needs spec_draft_model (a model path, 'default' or 'dummy:NAME')")
    # "default" is what the engine takes by default (SPECDEC_MODEL, else the default model)
    source = resolve_model(None if config.spec_draft_model == "default" else config.spec_draft_model)
    if source.config["vocab_size"] != target_source.config["vocab_size"]:
        raise ValueError(f"draft model {source.name!r} has vocabulary {source.config['vocab_size']}, the target "
                         f"{target_source.config['vocab_size']}: they must share the tokenizer")
    return source


class DraftModelDrafter(Drafter):
    name = "draft_model"
    uses_history = False

    def __init__(self, k: int, model, backend, num_blocks: int, block_size: int, max_model_len: int,
                 spec_kernels: bool = False):
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be an int >= 1, got {k!r}")
        self.num_speculative_tokens = self.lookahead = k
        self.model, self.backend = model, backend
        self.block_size, self.max_model_len = block_size, max_model_len
        self.spec_kernels = spec_kernels        # draft_layout in one kernel
        attn = model.layers[0].self_attn
        w = model.embed_tokens.weight
        shape = (num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
        self.kv_caches = kv_pages(len(model.layers), shape, w.dtype, w.device)

    def route_sites(self) -> list:
        return [site for site in self.model.route_sites() if site.op != "head"]    # drafts sample from logits

    def observe(self, ctx: FeatureContext) -> None:
        self.model(ctx.input_ids, ctx.positions, ctx.meta, self.kv_caches, self.backend)

    def propose(self, ctx: FeatureContext) -> Proposal:
        self.observe(ctx)
        start = ctx.last_position()
        k = ctx.depth or self.num_speculative_tokens
        pos, metas, _ = draft_layout(ctx, start, 1, k, self.block_size, self.max_model_len, self.spec_kernels)
        token, drafts = ctx.next_ids[ctx.last], []
        for j in range(k):
            hidden = self.model(token, pos[j], metas[j], self.kv_caches, self.backend)
            token = ctx.pick(j, self.model.compute_logits(hidden))
            drafts.append(token)
        tokens = torch.stack(drafts, dim=1)
        return Proposal(tokens, ctx.num_drafts(tokens))
