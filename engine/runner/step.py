"""The device work of one step, in order: carry-over, forward, logits, (grammar mask), sampling.

Carry-over and sampling go through the token pool (engine/memory/token_pool.py): a step takes the inputs the host has
not seen from its sequences' rows and writes each sampling row's token back to its row, for the next step.
A plain step is a speculative step with K = 0 in this respect (engine/runner/spec_step.py reads and writes the same
rows, drafts included).

Eager steps and CUDA graph captures (engine/runner/graphs.py) run these same methods, so a graph holds exactly
what an eager step computes, sampling included. A step's variant is (guided, greedy, extras): guided steps
fork the grammar branch (engine/guided/masks.py) at their start and wait for its `mask_ready` only before
sampling; greedy steps (every sampling row at temperature 0) skip the random-sampling kernels; extras steps
(some row asks for logprobs, penalties, min_p or min_tokens) count the inputs of penalized rows, penalize the
logits, filter by min_p and record the logprobs of the sampled tokens (engine/sampling/penalties.py,
engine/sampling/logprobs.py); no other step runs a kernel for them. A greedy step that is neither guided nor extras
computes no float32 logits where the backend has an LM head argmax for it (engine/backend.py: the route table's
kernel); a greedy guided one takes the backend's masked argmax of its logits (the mask and forced tokens in the
same two kernels), where it has one. Logits go: penalties and
min_tokens, grammar mask (logprobs are taken here), temperature, top-k, top-p, min_p.
Everything here is enqueue-only tensor code (no host sync), so it can be captured.
"""
from __future__ import annotations

import importlib
from typing import NamedTuple

import torch

from engine.attention import AttentionMetadata
from engine.runner.slots import DecodeSlot
from engine.sampling.logprobs import record
from engine.sampling.sampler import NO_TOKEN, apply_bitmask, sample


class StepVariant(NamedTuple):
    """Which kernels a step holds besides the forward (see the module docstring); a graph is captured per
    variant."""
    guided: bool    # the grammar branch and its mask
    greedy: bool    # every sampling row at temperature 0: no random-sampling kernels
    extras: bool    # logprobs, penalties, logit_bias, min_p, min_tokens


class StepProgram:
    def __init__(self, model, kv_caches, backend, max_model_len: int, compute_stream=None, masks=None,
                 penalties=None, pool=None, step_io: bool = False):
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.max_model_len = max_model_len
        self.compute_stream = compute_stream
        self.masks = masks                      # GrammarMasks (None: no guided steps)
        self.masker = getattr(backend, "apply_bitmask", apply_bitmask)
        self.penalties = penalties              # PenaltyState (None: the engine has no penalties)
        self.pool = pool                        # TokenPool (engine/memory/token_pool.py): carried inputs, emitted
                                                # tokens
        # Tuning.step_io_kernels: the input ids + embedding and the emit kernels (Triton: imported only then)
        self.step_io = importlib.import_module("engine.kernels.step_io") if step_io else None

    def inputs(self, slot: DecodeSlot, size: int, carry: bool = True):
        """(ids, embeds): the step's input ids (carried where they come from the pool) and, from the step_io
        kernels, their embedding rows (None: the model looks them up)."""
        d = slot.dev
        if self.step_io is not None:
            return self.step_io.inputs(d["input_ids"], d["carry_src"], d["tok_row"], self.pool.last_token,
                                       self.model.embed_tokens.weight, size, carry)
        ids = d["input_ids"][:size]
        return (self.pool.carried(ids, d["carry_src"][:size], d["tok_row"][:size]) if carry else ids), None

    @staticmethod
    def meta(slot: DecodeSlot, num_tokens: int, num_seqs: int, max_query_len: int, max_seq_len: int):
        d = slot.dev
        return AttentionMetadata(slot_mapping=d["slot_mapping"][:num_tokens],
                                 cu_seqlens_q=d["cu_seqlens_q"][:num_seqs + 1],
                                 seq_lens=d["seq_lens"][:num_seqs], block_tables=d["block_tables"][:num_seqs],
                                 max_query_len=max_query_len, max_seq_len=max_seq_len)

    def forward(self, slot: DecodeSlot, ids, num_seqs: int, max_query_len: int, max_seq_len: int, embeds=None):
        meta = self.meta(slot, ids.shape[0], num_seqs, max_query_len, max_seq_len)
        return self.model(ids, slot.dev["positions"][:ids.shape[0]], meta, self.kv_caches, self.backend, embeds=embeds)

    def observe(self, slot: DecodeSlot, ids, num_seqs: int, extras: bool) -> None:
        if extras and self.penalties is not None:
            self.penalties.observe(slot.dev, ids, ids.shape[0], num_seqs)

    def hidden(self, slot: DecodeSlot, extras: bool = False):
        """An eager step at its exact size: the final hidden states of the rows that sample (None if none do)."""
        n = slot.num_sample
        ids, embeds = self.inputs(slot, slot.num_tokens, carry=slot.num_carry > 0)
        self.observe(slot, ids, slot.num_seqs, extras)
        hidden = self.forward(slot, ids, slot.num_seqs, slot.max_query_len, slot.max_seq_len, embeds)
        return hidden[slot.dev["logits_indices"][:n]] if n else None

    def graph_hidden(self, slot: DecodeSlot, key, extras: bool = False):
        """Carry-over, then the forward of a step padded to `key` (a "decode" or "mixed" engine.runner.graphs.GraphKey):
        the final hidden states of its sampling rows."""
        ids, embeds = self.inputs(slot, key.tokens)
        self.observe(slot, ids, key.seqs, extras)
        if key.kind == "decode":
            return self.forward(slot, ids, key.seqs, 1, key.context, embeds)
        hidden = self.forward(slot, ids, key.seqs, key.tokens, key.context, embeds)
        return hidden[slot.dev["logits_indices"][:key.seqs]]

    def head_ids(self, hidden, variant: StepVariant):
        """A greedy step's tokens straight from the backend's LM head argmax kernels, or None where the step needs
        its logits (head_argmax)."""
        if hidden is None:
            return None
        return head_argmax(self.model, self.backend, hidden, variant)

    def masked_greedy(self, hidden, variant: StepVariant) -> bool:
        """Whether a step's tokens come from the backend's masked argmax (a greedy guided step without extras on
        one rank): the sampler's greedy answer on the masked logits, forced tokens included, in two kernels."""
        guided, greedy, extras = variant
        return guided and greedy and not extras and self.model.tp.world == 1 \
            and getattr(self.backend, "masks_greedy", None) is not None and self.backend.masks_greedy(hidden)

    def step(self, slot: DecodeSlot, prev: DecodeSlot, variant: StepVariant, key=None) -> None:
        """The whole step into `slot.sampled`: at its exact size (key None, eager) or padded to a graph key."""
        guided, greedy, extras = variant
        rows = slot.num_sample if key is None else key.seqs
        if guided and self.masks.cuda:
            self.masks.branch(slot, prev, rows, self.compute_stream)
        hidden = self.hidden(slot, extras) if key is None else self.graph_hidden(slot, key, extras)
        tokens = self.head_ids(hidden, variant)
        masked = tokens is None and hidden is not None and self.masked_greedy(hidden, variant)
        logits = None
        if tokens is None and hidden is not None:
            logits = self.model.compute_logits(hidden, float32=False) if masked else self.model.compute_logits(hidden)
        mark(slot, "forward_done")
        mask = self.masks.join(slot, prev, rows, self.compute_stream)[0] if guided else None
        mark(slot, "mask_waited")
        if rows and tokens is not None:
            self.emit(slot, tokens, rows)
        elif rows and masked:
            self.emit(slot, self.backend.masked_argmax(logits, mask, slot.dev["forced"][:rows]), rows)
        elif rows:
            self.sample(slot, logits, rows, greedy, mask, extras)

    def emit(self, slot: DecodeSlot, tokens, rows: int) -> None:
        if self.step_io is not None:
            self.step_io.emit(tokens[:rows], slot.sampled, slot.dev["smp_row"], self.pool.last_token)
            return
        slot.sampled[:rows] = tokens
        self.pool.emit(slot.dev["smp_row"][:rows], tokens)

    def sample(self, slot: DecodeSlot, logits, rows: int, greedy: bool, mask=None, extras: bool = False):
        """Tokens [rows] from `logits` (penalized and masked in place) into `slot.sampled`; returns them."""
        d = slot.dev
        min_p = None
        if extras and self.penalties is not None:
            self.penalties.apply(logits, d, rows)
            min_p = d["min_p"][:rows]
        tokens = sample(logits, d["temperature"][:rows], d["top_k"][:rows], d["top_p"][:rows], d["seeds"][:rows],
                        d["steps"][:rows], bitmask=mask, all_greedy=greedy, masker=self.masker, min_p=min_p)
        if mask is not None:
            tokens = forced(tokens, d["forced"][:rows])
        self.emit(slot, tokens, rows)
        if extras and slot.logprobs is not None:
            record(slot.logprobs[:rows, :1], logits, tokens[:, None])
        return tokens


def forced(tokens: torch.Tensor, forced_ids: torch.Tensor) -> torch.Tensor:
    """A guided step's tokens, with the host's choice where it forces one (>= 0): the closing of a guided output
    (engine/guided/closing.py)."""
    return torch.where(forced_ids >= 0, forced_ids, tokens)


def head_argmax(model, backend, hidden, variant: StepVariant):
    """The LM head's argmax of `hidden` from the backend's kernels (int64), or None where the step needs its
    logits: a sampled step draws from them, a guided one masks them, an extras one penalizes them or records their
    logprobs; a head split over ranks gathers its vocabulary; the backend may have no kernels for it."""
    guided, greedy, extras = variant
    if not greedy or guided or extras or model.tp.world > 1:
        return None
    return backend.linear_argmax(hidden, model.head_weight)


def mark(slot: DecodeSlot, name: str) -> None:
    if slot.marks is not None:
        slot.marks[name].record()


def first_token(tokens, lead, forced_ids):
    """A guided step's first emitted token: NO_TOKEN where position 0's mask allowed nothing (lead 0), the host's
    token for a row closing its output (engine/guided/closing.py), which verifies no draft."""
    first = torch.arange(tokens.shape[1], device=tokens.device)[None, :] == 0
    tokens = torch.where(first & (lead == 0)[:, None], NO_TOKEN, tokens)
    return torch.cat([forced(tokens[:, :1], forced_ids[:, None]), tokens[:, 1:]], dim=1)
