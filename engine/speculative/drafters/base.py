"""The drafter interface: what every speculative-decoding drafting method takes and returns.

A drafter guesses the next K tokens of each running request; the target model then verifies them in one
forward. Drafting runs inside the step's CUDA graph, so `propose` must be enqueue-only tensor code: no host
sync (.item(), .tolist(), .nonzero(), boolean-mask indexing, Python branching on tensor values) and output
shapes that depend only on input shapes and the drafter's configuration. A new method is one file: subclass
`Drafter`, set `name` and `num_speculative_tokens`, implement `propose`.

Inputs travel in one of two contexts, picked by the drafter's `uses_history`: a `DraftContext` (the token
history, for methods that search it) or a `FeatureContext` (the step itself: its tokens, the target's hidden
states at them, positions and attention metadata, for a head or a draft model with a paged KV cache of its
own), rather than each new method changing `propose`'s signature. This mirrors vLLM, whose n-gram proposer reads
token ids alone while its EAGLE proposer also takes target hidden states and attention metadata, and
SGLang, whose EAGLE worker carries them in a draft-input object next to the batch.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.attention import AttentionMetadata


@dataclass
class DraftContext:
    """One step's drafting inputs for N rows (one per request), on the engine's device.

    history: [N, L] integer token ids. Row r holds request r's prompt followed by its output tokens so far;
        the last valid one, history[r, lengths[r] - 1], is the newest token (sampled by the target at this
        step), and the drafts guess positions lengths[r], lengths[r] + 1, ... Positions >= lengths[r] are
        padding with any value; drafters must not read meaning into them.
    lengths: [N] int64, valid tokens per row, 0 <= lengths[r] <= L. Not checked against L: that would sync.
    rows: None, or [N] integer rows of `history`, which is then a whole table [R, L]: context row r is
        history[rows[r]] (-1: the table's last row, as torch indexing reads it). `table()` gathers them.
    """
    history: torch.Tensor
    lengths: torch.Tensor
    rows: torch.Tensor | None = None

    def table(self) -> torch.Tensor:
        """The context's own rows, [N, L]."""
        return self.history if self.rows is None else self.history[self.rows]


@dataclass
class FeatureContext:
    """What a drafter with its own paged KV cache (a head, a draft model) reads from a step.

    next_ids: [T] int64, the token after each input (a prompt's next token, or what the step emitted).
    positions: [T] int64 and meta (AttentionMetadata): the step's corrected positions, slot mapping, block
        tables and sequence lengths; a drafter with its own paged KV cache writes it with them.
    last: [S] int64, each sampling row's last verified input token (drafts continue after the token it
        predicted); last_seq: [S] its sequence in meta; last_valid: [S] bool, False for padding rows.
    kv_cap: [B] int64, tokens the pages of each sequence hold (a drafter writing past its input positions
        must stay below it).
    input_ids: [T] int64, the step's input tokens (carried ones filled in); read by a draft model.
    features: [T, F] the target's hidden states at the drafter's `feature_layers`, one row per input token;
        read by a head (None when the drafter names no feature layers).
    guide: DraftMasks (engine/guided/draft_masks.py) when the step has guided rows and draft masks or forced
        drafts are on: draft j is then `guide.pick(j, logits)` (masked, maybe forced) instead of the argmax
        (a draft tree's candidates `guide.top(j, logits, n)`), and `guide.num_drafts()` counts each row's drafts
        (a row stops where its grammar ends or fails).
    start: [S] int64, positions[last], or None (last_position() indexes it).
    depth: drafts a chain drafter makes this step (0: its K). A step verifying a lower level of K drafts that
        many for the next step: a level held step after step then costs what an engine of that K costs.
    """
    next_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    last: torch.Tensor
    last_seq: torch.Tensor
    last_valid: torch.Tensor
    kv_cap: torch.Tensor
    input_ids: torch.Tensor | None = None
    features: torch.Tensor | None = None
    guide: object = None
    start: torch.Tensor | None = None
    depth: int = 0

    def last_position(self) -> torch.Tensor:
        """[S] int64, positions[last]: `start` where the step computed it already."""
        return self.positions[self.last] if self.start is None else self.start

    def pick(self, j: int, logits: torch.Tensor) -> torch.Tensor:
        """Draft token j of every row from the drafter's logits [S, V] (under the grammar if guided)."""
        return self.guide.pick(j, logits) if self.guide is not None else logits.argmax(-1)

    def top(self, j: int, logits: torch.Tensor, n: int) -> torch.Tensor:
        """Draft j's n best candidates [S, n] (a draft tree's chain token first; under the grammar if guided)."""
        return self.guide.top(j, logits, n) if self.guide is not None else logits.topk(n, dim=-1).indices

    def num_drafts(self, tokens: torch.Tensor) -> torch.Tensor:
        """Drafts per row of [S, K] picked tokens."""
        if self.guide is not None:
            return self.guide.num_drafts()
        return torch.full_like(tokens[:, 0], tokens.shape[1])


class Proposal(NamedTuple):
    """A drafter's output for N rows and K = num_speculative_tokens. Unpacks as a tuple.

    draft_tokens: [N, K] int64. Row r's drafts are draft_tokens[r, :num_drafts[r]]; the positions after
        them hold a valid token id (the drafter documents which) so they can be fed to the target's forward
        unmasked, but verification must treat them as rejected.
    num_drafts: [N] int64 in [0, K]; 0 means the drafter has no guess for that row.

    Drafts are verified as deterministic proposals (the draft distribution q one-hot at the draft token), which
    keeps rejection sampling lossless whatever the drafter: a drafter that samples its drafts loses no
    correctness, only acceptance. (engine/speculative/verify.py's rejection_sample takes a full q, but the step keeps
    only the K drafts per row between steps, not K distributions over the vocabulary.)
    """
    draft_tokens: torch.Tensor
    num_drafts: torch.Tensor


class Drafter(abc.ABC):
    """A drafting method. Subclasses set `name` (class attribute, e.g. "ngram") and
    `num_speculative_tokens` (K, fixed at construction: graph shapes are sized from it)."""

    name: str
    num_speculative_tokens: int
    uses_history = True     # False: gets a FeatureContext (and sets feature_layers, the target layers it reads)
    feature_layers: tuple = ()
    lookahead = 0           # positions past a row's inputs it writes KV at (the scheduler reserves pages for them)
    lends_vocab = False     # its vocabulary takes admitted prompts' and guides' ids (vocab_writes)

    def route_sites(self) -> list:
        """The drafter's matmuls whose kernels the route table chooses (engine/kernels/routes.py Site): none for
        a drafter without a model."""
        return []

    @abc.abstractmethod
    def propose(self, ctx: DraftContext | FeatureContext) -> Proposal:
        """Draft up to K tokens per row of `ctx`; fixed-shape, no host sync (see the module docstring)."""

    def observe(self, ctx: DraftContext | FeatureContext) -> None:
        """A step that drafts nothing (too many rows) still shows the drafter its tokens: a drafter with state
        of its own (a head's KV cache) updates it here. Stateless drafters need nothing."""

    def vocab_writes(self, rows) -> dict[int, int] | None:
        """Host, while a step is planned: what the step's admissions change in the drafter's vocabulary, for
        write_vocab before the step runs (None: nothing)."""
        return None

    def write_vocab(self, writes: dict[int, int]) -> None:
        """On the compute stream, before the step whose vocab_writes these are."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, k={self.num_speculative_tokens})"


def draft_layout(ctx: FeatureContext, start, offset: int, k: int, block_size: int, max_model_len: int,
                 kernels: bool = False, rows=(), gather: bool = False):
    """Where a paged drafter's K single-token forwards sit: (positions [K, S], [AttentionMetadata] * K, each of
    `rows` indexed by ctx.last), forward i of every sampling row at position start + offset + i, writing its KV
    slot and attending to its sequence up to there. A row whose pages (kv_cap) or context do not reach the position
    writes nothing (slot -1) and attends to what its pages hold up to `start` (always written); so do padding rows
    (last_valid False). kernels (Tuning.spec_kernels): the tensors in one launch
    (engine/kernels/speculative/spec_ops.py), else torch ops; gather (Tuning.draft_gather): that launch also
    gathers `rows` where it can."""
    gathered = ()
    if kernels:
        from engine.kernels.speculative import spec_ops
        pos, mapping, seq_lens, table, cu, gathered = spec_ops.draft_layout(ctx, start, offset, k, block_size,
                                                                             max_model_len, rows if gather else ())
    else:
        pos, mapping, seq_lens, table, cu = _layout(ctx, start, offset, k, block_size, max_model_len)
    metas = [AttentionMetadata(mapping[i], cu, seq_lens[i], table, 1, ctx.meta.max_seq_len) for i in range(k)]
    return pos, metas, gathered or tuple(x[ctx.last] for x in rows)


def _layout(ctx: FeatureContext, start, offset: int, k: int, block_size: int, max_model_len: int):
    """draft_layout's tensors in torch ops: (positions, slot mappings, seq_lens, block tables, cu_seqlens)."""
    table = ctx.meta.block_tables[ctx.last_seq]
    cap = ctx.kv_cap[ctx.last_seq].clamp(max=max_model_len)
    pos = start[:, None] + offset + torch.arange(k, device=start.device)[None, :]
    ok = ctx.last_valid[:, None] & (pos < cap[:, None])
    page = table.gather(1, (pos // block_size).clamp(max=table.shape[1] - 1)).long()
    mapping = torch.where(ok, page * block_size + pos % block_size, -1).t().contiguous()
    seq_lens = torch.where(ok, pos + 1, start[:, None] + 1).int().t().contiguous()
    cu = torch.arange(start.shape[0] + 1, dtype=torch.int32, device=start.device)
    return pos.clamp(max=max_model_len).t().contiguous(), mapping, seq_lens, table, cu
