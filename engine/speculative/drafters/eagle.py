"""EAGLE-3-style drafting with a trained one-layer head (engine/speculative/eagle_head.py, eagle_paged.py), inside the
target's step graph.

Every step, the head writes its KV for the step's tokens from the target's hidden states at its feature layers
(`PagedHead.write_kv`). A row that drafts then runs K single-token layers from its last verified input t:
step 0 queries at t, step i >= 1 at t + i, and each hidden state's argmax under the target's LM head is the
next draft (under the row's grammar mask, or grammar-forced, in a guided step: FeatureContext.pick). Drafts are
greedy, so verification takes them as one-hot proposals, which
keeps rejection sampling lossless. Where the route table gives the draft's head ("norm_head") the GEMV, an
unguided draft of a few rows takes no logits:
the final norm, LM head and argmax are two kernels of the decode GEMV's dependent-launch chain
(engine/kernels/matmul/draft_gemv.py), and the layer's residual add is its down projection's epilogue.

Draft step i writes its key at position t + i, which may lie past the step's inputs: the scheduler reserves
K - 1 tokens of pages ahead when it can (`Drafter.lookahead`), and a write that would land past a
sequence's pages (`kv_cap`) or the context is dropped (that draft is then a poor guess, never a wrong output).
"""
from __future__ import annotations

import torch

from engine.speculative.drafters.base import Drafter, FeatureContext, Proposal, draft_layout
from engine.speculative.eagle_paged import PagedHead


class EagleDrafter(Drafter):
    name = "eagle"
    uses_history = False

    def __init__(self, k: int, head: PagedHead, block_size: int, max_model_len: int, spec_kernels: bool = False,
                 gather: bool = False, tree=None):
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be an int >= 1, got {k!r}")
        if tree is not None and tree.depth != k:
            raise ValueError(f"a draft tree of depth {tree.depth} needs k = {tree.depth}, got {k}")
        self.num_speculative_tokens = k
        self.lookahead = k - 1                  # draft step i writes its key at t + i
        self.tree = tree                        # engine/speculative/tree.py DraftTree: its leaves follow the chain
        self.head = head
        self.feature_layers = tuple(head.cfg.feature_layers)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.spec_kernels = spec_kernels        # draft_layout in one kernel
        self.gather = gather                    # ... which also gathers the step-0 queries and features
        # every unguided row drafts all k of its level: count k is counts[k] broadcast, a view and not a kernel
        self.counts = torch.arange(k + 1, device=head.fc_weight.device)

    def route_sites(self) -> list:
        return self.head.route_sites()

    @property
    def lends_vocab(self) -> bool:
        return self.head.prompt_vocab is not None

    def vocab_writes(self, rows) -> dict[int, int] | None:
        """The prompts of the step's admissions (their first chunk: more than one token from their cached
        prefix on), and a guided one's guide text (GuidedRequest.guide_ids), in the draft vocabulary's spare
        rows."""
        vocab = self.head.prompt_vocab
        if vocab is None:
            return None
        writes = {}
        for row in rows:
            if row.num_tokens > 1 and row.start == row.cached:
                vocab.admit(row.seq.prompt_token_ids, writes)
                if row.seq.guided is not None:
                    vocab.admit(row.seq.guided.guide_ids, writes)
        return writes or None

    def write_vocab(self, writes: dict[int, int]) -> None:
        self.head.write_vocab(writes)

    def observe(self, ctx: FeatureContext) -> None:
        self.head.write_kv(ctx.features, ctx.next_ids, ctx.positions, ctx.meta.slot_mapping)

    def propose(self, ctx: FeatureContext) -> Proposal:
        q, feature = self.head.write_kv(ctx.features, ctx.next_ids, ctx.positions, ctx.meta.slot_mapping)
        start = ctx.last_position()
        k = ctx.depth or self.num_speculative_tokens      # (a tree engine's steps draft the whole tree: depth 0)
        pos, metas, (q, feature) = draft_layout(ctx, start, 0, k, self.block_size, self.max_model_len,
                                                self.spec_kernels, (q, feature), self.gather)
        hidden = self.head.attend(q, metas[0], feature)
        if self.tree is not None:
            return self._tree(ctx, hidden, pos, metas)
        # draft i is row i of [K, S]: the argmax kernels write it in place, so no stacking follows
        drafts = torch.empty((k, hidden.shape[0]), dtype=torch.int64, device=hidden.device)
        self._pick(ctx, 0, hidden, drafts[0])
        for i in range(1, k):
            hidden = self.head.step(hidden, drafts[i - 1], pos[i], metas[i])
            self._pick(ctx, i, hidden, drafts[i])
        tokens = drafts.t()
        count = self.counts[k].expand(tokens.shape[0]) if ctx.guide is None else ctx.num_drafts(tokens)
        return Proposal(tokens, count)

    def _tree(self, ctx: FeatureContext, hidden, pos, metas) -> Proposal:
        """A draft tree's tokens [S, N]: the chain of first choices, then each leaf (depth d, rank r) the head's
        choice r at depth d (a guided step's under the grammar's draft masks, where it has them)."""
        widths = self.tree.widths()
        ranked = [self._top(ctx, 0, hidden, widths[0])]
        for i in range(1, self.num_speculative_tokens):
            hidden = self.head.step(hidden, ranked[-1][:, 0], pos[i], metas[i])
            ranked.append(self._top(ctx, i, hidden, widths[i]))
        chain = [r[:, 0] for r in ranked]
        leaves = [ranked[d - 1][:, r] for d, r in self.tree.leaves]
        tokens = torch.stack(chain + leaves, dim=1)
        return Proposal(tokens, ctx.num_drafts(tokens[:, :self.num_speculative_tokens]))

    def _top(self, ctx: FeatureContext, j: int, hidden, n: int):
        return self.head.top(hidden, n) if ctx.guide is None else ctx.top(j, self.head.logits(hidden), n)

    def _pick(self, ctx: FeatureContext, j: int, hidden, out) -> None:
        """Draft j from the head's hidden states into `out`: unguided, the backend's argmax kernels where it has
        them (engine/backend.py), else ctx.pick on the logits."""
        tokens = self.head.greedy(hidden, out) if ctx.guide is None else None
        if tokens is None:
            tokens = ctx.pick(j, self.head.logits(hidden))
        if tokens is not out:
            out.copy_(tokens)
