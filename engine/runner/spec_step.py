"""The step program with speculation: engine/runner/step.py's order, plus on-device correction, verification and
drafting.

Every step of a speculating engine (spec steps and plain ones) runs:
1. correct: the host planned each sequence with an uncommitted step as if all its drafts were accepted;
   positions, slot mapping, seq_lens and sampling indices move back by that step's rejected count
   (SpecState.rejected). Carried inputs come from SpecState (last token, drafts), and the step's inputs are
   recorded in the sequences' token histories.
2. forward + logits: a spec step ("spec" graph key, or eager with slot.spec_k = K) has 1 + K query tokens in
   every row (the last token, then K drafts) and scores all of them. A tree engine's step of the tree's N
   drafts attends by the tree's masks and verifies the tree (engine/runner/tree_step.py). A greedy spec step
   that nothing else reads the logits of (unguided, no extras) takes only their argmax, from the backend's
   kernels where it has them (target_ids: engine/backend.py, the route table's kernel); so does such a plain
   step of one-token rows.
3. verify (greedy_accept, or rejection_sample for sampled rows) or sample (plain steps); emitted tokens go
   to `slot.spec_out` and the histories, the last one to `last_token`, K - accepted to `rejected`. A
   logprobs step records the target's logprobs of the tokens at every scored position (engine/sampling/logprobs.py):
   the host keeps those of the emitted ones. With Tuning.spec_finish_kernel a greedy step without grammar
   that has the target's argmax does all of it (and the draft head's next_tokens) in one kernel.
4. draft: the drafter guesses the next K tokens of each sampling row into SpecState.drafts, if the step
   has few enough rows that its sequences may speculate next and is not a quiet step (a paused engine's).
All of it is enqueue-only tensor code with shapes fixed by the step's key, so it is captured with the rest.
"""
from __future__ import annotations

import torch

from engine.runner.step import StepProgram, first_token, head_argmax, mark
from engine.runner.tree_step import depth_positions, head_meta, is_tree_step, tree_parts, verify_tree
from engine.sampling.logprobs import record
from engine.sampling.sampler import NO_TOKEN
from engine.speculative.drafters.base import DraftContext, FeatureContext
from engine.speculative.verify import PAD, greedy_accept, greedy_accept_ids, rejection_sample


class SpecStepProgram(StepProgram):
    def __init__(self, *args, state, drafter, block_size: int, draft_max_rows: int, draft_masks=None,
                 spec_kernels: bool = False, finish_kernel: bool = False, tree=None, **kwargs):
        super().__init__(*args, pool=state, **kwargs)
        # a draft tree's tables, the KV as one view, its finish kernels (engine/runner/tree_step.py)
        self.tree, self.kv_slab, self.tree_finish = tree_parts(tree, state.rejected.device, self.kv_caches,
                                                               finish_kernel)
        self.draft_masks = draft_masks          # DraftMasks (engine/guided/draft_masks.py) of guided drafting steps
        self.state = state
        self.drafter = drafter
        self.block_size = block_size
        self.draft_max_rows = draft_max_rows    # steps with more sampling rows skip drafting
        self.aux_layers = tuple(drafter.feature_layers)
        self.spec_ops = self.spec_finish = None  # Tuning.spec_kernels: correct in one kernel
        if spec_kernels:
            from engine.kernels.speculative import spec_ops
            self.spec_ops = spec_ops
        if finish_kernel:                        # Tuning.spec_finish_kernel: the greedy finish in one kernel
            from engine.kernels.speculative import spec_finish
            self.spec_finish = spec_finish

    def sizes(self, slot, key) -> tuple[int, int, int, int]:
        """(tokens, sequences, sampling rows, K) of a step at its exact size (key None) or padded to a key."""
        if key is None:
            return slot.num_tokens, slot.num_seqs, slot.num_sample, slot.spec_k
        return key.tokens, key.seqs, key.seqs, key.spec_k

    def step(self, slot, prev, variant, key=None) -> None:
        """The whole speculative step (variant: engine.runner.step.StepVariant; key: an engine.runner.graphs.GraphKey
        or None for an eager step at its exact size)."""
        guided, _, extras = variant
        T, B, S, K = self.sizes(slot, key)
        tree = is_tree_step(self.tree, K, variant)
        ids, drafted = self.correct(slot, T, B, S, K)
        if tree:
            depth_positions(slot.dev, T, self.tree)
        self.observe(slot, ids, B, extras)
        drafted = self.drafted(slot, ids, S, K, guided, drafted)
        if guided and self.masks.cuda:
            self.masks.branch(slot, prev, S, self.compute_stream, K + 1)
        meta = self.step_meta(slot, key, T, B, K, self.tree.masks if tree else None)
        embeds = self.step_io.embed(ids, self.model.embed_tokens.weight) if self.step_io is not None else None
        out = self.model(ids, slot.dev["positions"][:T], meta, self.kv_caches, self.backend, self.aux_layers,
                         embeds=embeds)
        hidden, features = out if self.aux_layers else (out, None)
        one_token = key.kind == "decode" if key is not None else slot.max_query_len == 1 and slot.num_sample == T
        target = self.target_ids(hidden, variant, T, S, K, one_token)
        masked = target is None and S > 0 and self.masked_greedy(hidden, variant)
        logits = self.spec_logits(slot, hidden, key, T, S, K, masked=masked) if target is None else None
        mark(slot, "forward_done")
        grammar = self.masks.join(slot, prev, S, self.compute_stream, K + 1) if guided else None
        mark(slot, "mask_waited")
        tokens = accepted = finished = None
        if S and tree:
            tokens, accepted, finished = verify_tree(self, slot, ids, logits, target, drafted, S, K, T, variant.greedy,
                                                     grammar, masked)
        elif S:
            tokens, accepted, finished = self.verify_finish(slot, ids, logits, target, drafted, variant, grammar, S, K,
                                                            masked)
        quiet = slot.quiet if key is None else not key.drafts
        self.draft(slot, ids, features, meta, tokens, accepted, finished, T, S, K, guided,
                   key.context + K + 2 if key is not None else None, quiet)

    # ---- 1. correct ----------------------------------------------------------------------------
    def correct(self, slot, T: int, B: int, S: int, K: int = 0):
        """-> (the step's input ids [T], the drafts each sampling row verifies [S] where the correction kernel
        counted them (a spec step's), else None)."""
        d, st, bs = slot.dev, self.state, self.block_size
        if self.spec_ops is not None:
            if S and K:
                return self.spec_ops.correct(d, st, T, B, S, bs, self.drafter.uses_history, drafted=True)
            return self.spec_ops.correct(d, st, T, B, S, bs, self.drafter.uses_history), None
        tok_rows = d["tok_row"][:T]
        pos = d["positions"][:T]
        pos.sub_(torch.where(d["shift"][:T] > 0, st.rejected[tok_rows], 0))
        page = d["block_tables"][d["tok_seq"][:T], pos // bs].long()
        mapping = d["slot_mapping"][:T]
        mapping.copy_(torch.where(mapping >= 0, page * bs + pos % bs, mapping))
        seq_shift = d["seq_shift"][:B]
        d["seq_lens"][:B].sub_(torch.where(seq_shift >= 0, st.rejected[seq_shift.clamp(min=0)], 0).int())
        smp_rows = d["smp_row"][:S]
        d["steps"][:S].sub_(torch.where(d["smp_shift"][:S] > 0, st.rejected[smp_rows], 0))
        ids = st.carried(d["input_ids"][:T], d["carry_src"][:T], tok_rows)
        if self.drafter.uses_history:
            st.history[tok_rows, pos.clamp(max=st.max_model_len)] = ids.int()
        return ids, None

    # ---- 2. forward + logits -------------------------------------------------------------------
    def step_meta(self, slot, key, T: int, B: int, K: int, tree_masks=None):
        """Attention metadata of the step at its exact size (key None) or padded to its graph key."""
        if K:
            meta = self.meta(slot, T, B, K + 1, key.context if key else slot.max_seq_len)
            meta.tree_masks = tree_masks
            return meta
        if key is None:
            return self.meta(slot, T, B, slot.max_query_len, slot.max_seq_len)
        if key.kind == "decode":
            return self.meta(slot, T, B, 1, key.context)
        return self.meta(slot, T, B, T, key.context)

    def spec_logits(self, slot, hidden, key, T: int, S: int, K: int, masked: bool = False):
        """The sampling positions' logits: float32, or the dtype's for the masked argmax (StepProgram.masked_greedy)."""
        if K or (key is not None and key.kind == "decode"):
            rows = hidden[:T]
        elif S:
            rows = hidden[slot.dev["logits_indices"][:S]]
        else:
            return None
        return self.model.compute_logits(rows, float32=False) if masked else self.model.compute_logits(rows)

    def target_ids(self, hidden, variant, T: int, S: int, K: int, one_token: bool = False):
        """The target's argmax [S, K + 1] of a spec step's positions (or of a plain step's, K = 0, whose rows are one
        token each: `one_token`) from the backend's kernels, or None where the step computes its float32 logits
        (engine.runner.step.head_argmax)."""
        if not S or not (K or one_token):
            return None
        ids = head_argmax(self.model, self.backend, hidden[:T], variant)
        return None if ids is None else ids.view(S, K + 1)

    # ---- 3. verify or sample -------------------------------------------------------------------
    def verify_finish(self, slot, ids, logits, target, drafted, variant, grammar, S: int, K: int, masked=False):
        """verify, record an extras step's logprobs, finish -> (tokens, accepted, what the finish kernel computed for
        the draft or None: (next_tokens of the inputs, its draft rows or None)). spec_kernels: a greedy spec step
        without grammar (or a plain one whose argmax the head kernels took) takes one kernel for all but the
        logits' argmax; so does a masked greedy guided one without draft masks, once its grammar caps its drafts."""
        _, greedy, extras = variant
        finished = None
        # forcing a closing row's first token in the target equals forcing its output: such rows verify no draft
        guided_finish = grammar is not None and masked and K and self.draft_masks is None
        if self.spec_finish is not None and (K or target is not None) and greedy and (grammar is None or guided_finish):
            if guided_finish:
                target, _, lead, drafted = self.apply_grammar(logits, grammar, drafted, S, K, masked)
                target = first_token(target, lead, slot.dev["forced"][:S])
            target = logits.view(S, K + 1, -1).argmax(dim=-1) if target is None else target
            if drafted is None:             # a plain step: its rows' draft caps are all 0
                drafted = slot.dev["num_drafts"][:S]
            history = self.drafter.uses_history
            rows = not history and S <= self.draft_max_rows
            tokens, accepted, next_ids, draft_rows = self.spec_finish.greedy_finish(
                slot, self.state, ids, target, drafted, K, history, not history, rows)
            finished = None if history else (next_ids, draft_rows)
        else:
            tokens, accepted, drafted = self.verify(slot, ids, logits, S, K, greedy, grammar, drafted, extras, target,
                                                    masked)
            self.finish(slot, tokens, accepted, drafted, S, K)
        if extras and K and slot.logprobs is not None:  # `logits` as verified: the grammar's masks applied
            record(slot.logprobs[:S, :K + 1], logits, tokens)
        return tokens, accepted, finished

    def drafted(self, slot, ids, S: int, K: int, guided: bool, drafted=None):
        """Drafts each row verifies (the host's cap and what the drafter proposed; `drafted` where the correction
        kernel counted them); a guided step hands its drafts and these counts to the grammar callback, which walks
        them before verification."""
        if not (S and K):
            return None
        if drafted is None:
            rows = slot.dev["smp_row"][:S]
            drafted = torch.minimum(slot.dev["num_drafts"][:S], self.state.draft_count[rows])
        if guided:
            out = self.masks.drafts_dev[slot.index]
            out[:S, :K] = ids.view(S, K + 1)[:, 1:]
            out[:S, self.state.k] = drafted         # (the grammar node reads the count at the engine's K)
        return drafted

    def verify(self, slot, ids, logits, S: int, K: int, greedy: bool, grammar, drafted, extras: bool = False,
               target=None, masked: bool = False):
        """-> (tokens [S, K + 1] with PAD after the emitted ones, accepted [S], drafts verified [S]).
        grammar: (masks [S * (K + 1)], drafts the grammar accepts [S]) of a guided step; target: target_ids (logits
        None then). masked: a greedy guided step's logits in the model's dtype, masked and reduced by the backend's
        masked argmax (its NO_TOKEN marks a position whose mask allows nothing). Penalized rows never speculate
        (engine/sampling/penalties.py): only plain steps apply penalties."""
        d = slot.dev
        params = (d["temperature"][:S], d["top_k"][:S], d["top_p"][:S], d["seeds"][:S], d["steps"][:S])
        if not K:
            if target is not None:                  # the head kernels' argmax
                tokens = target[:, 0]
                self.emit(slot, tokens, S)
            elif masked:
                tokens = self.backend.masked_argmax(logits, grammar[0], d["forced"][:S])
                self.emit(slot, tokens, S)
            else:
                tokens = self.sample(slot, logits, S, greedy, grammar and grammar[0], extras)
            zeros = torch.zeros_like(tokens)
            return tokens[:, None], zeros, zeros
        drafts = ids.view(S, K + 1)[:, 1:]
        if target is not None:
            accepted, tokens = greedy_accept_ids(drafts, target, drafted)
            return tokens, accepted, drafted
        lead = None
        if grammar is not None:
            target, _, lead, drafted = self.apply_grammar(logits, grammar, drafted, S, K, masked)
        if masked:
            accepted, tokens = greedy_accept_ids(drafts, target, drafted)
        elif greedy:
            accepted, tokens = greedy_accept(drafts, logits.view(S, K + 1, -1), drafted)
        else:
            accepted, tokens = rejection_sample(drafts, None, logits.view(S, K + 1, -1), drafted, *params)
        if lead is not None:
            tokens = first_token(tokens, lead, d["forced"][:S])
        return tokens, accepted, drafted

    def apply_grammar(self, logits, grammar, drafted, S: int, K: int, masked: bool, chain: int | None = None):
        """A guided step's masks on its logits [S * (K + 1)] -> (the masked argmax [S, K + 1] where `masked`, else
        None; whether each position's mask allows a token [S, K + 1]; lead [S]: the leading positions of the first
        1 + `chain` (a tree's chain, else all) that allow one; the drafts each row may accept [S]: `drafted` capped
        by the grammar's walk and before the first position that allows nothing). Unmasked, the masks apply in
        place; a position whose mask allows nothing stays unmasked and emits no token: drafts stop before it, and
        at position 0 the row gets NO_TOKEN (its request fails alone)."""
        if masked:
            target = self.backend.masked_argmax(logits, grammar[0]).view(S, K + 1)
            allows = target != NO_TOKEN
        else:
            target, allows = None, self.masker(logits, grammar[0]).view(S, K + 1)
        lead = allows[:, :(K if chain is None else chain) + 1].long().cumprod(dim=1).sum(dim=1)
        drafted = torch.minimum(torch.minimum(drafted, grammar[1]), (lead - 1).clamp(min=0))
        return target, allows, lead, drafted

    # ---- 4. record and draft -------------------------------------------------------------------
    def finish(self, slot, tokens, accepted, drafted, S: int, K: int) -> None:
        d, st = slot.dev, self.state
        rows = d["smp_row"][:S]
        if self.drafter.uses_history:
            first = d["positions"][d["logits_indices"][:S]]      # corrected position of the first scored token
            j = torch.arange(K + 1, device=tokens.device)
            cols = first[:, None] + 1 + j[None, :]
            cols = torch.where((j[None, :] <= accepted[:, None]) & (cols < st.max_model_len), cols, st.max_model_len)
            st.history[rows[:, None].expand(S, K + 1), cols] = tokens.clamp(min=0).int()
        if K:                                                   # a K = 0 step's sampling wrote it already
            st.emit(rows, tokens.gather(1, accepted[:, None])[:, 0])
        st.rejected[rows] = K - accepted
        out = slot.spec_out
        out[:S, :K + 1] = tokens
        out[:S, K + 1:st.k + 1] = PAD
        out[:S, st.k + 1] = drafted
        slot.sampled[:S] = tokens[:, 0]

    def draft(self, slot, ids, features, meta, tokens, accepted, finished, T: int, S: int, K: int,
              guided: bool, bound: int | None = None, quiet: bool = False) -> None:
        """Drafts for the next step into SpecState, if the step has few enough sampling rows that its
        sequences may speculate next and is not quiet (the next step will not speculate: engine/speculative/plan.py);
        a drafter with state (the EAGLE head's KV) sees every step's tokens.
        finished: (next_tokens, the rows' (last, last_seq, start, last_valid) or None), if the step's finish
        kernel computed them already. bound: a graph's context bound + K + 2, past every row's valid history
        (a row's length after the step is at most its seq_len + 1): the n-gram search reads no further."""
        d, st = slot.dev, self.state
        rows = d["smp_row"][:S]
        drafting = 0 < S <= self.draft_max_rows and not quiet
        if self.drafter.uses_history:
            if drafting:
                first = d["positions"][d["logits_indices"][:S]]
                ctx = DraftContext(st.history[:, :bound], first + 2 + accepted, rows)
        else:
            next_ids, draft_rows = (finished or (None, None))[:2]
            meta = head_meta(meta, finished)
            if next_ids is None:
                next_ids = self.next_tokens(slot, ids, tokens, T)
            if draft_rows is None:
                last = d["logits_indices"][:S] + (accepted if S else 0)     # each row's last verified input
                draft_rows = last, d["tok_seq"][last], None, d["smp_row"][:S] >= 0
            last, last_seq, start, last_valid = draft_rows
            # a chain step of level K drafts K for the next (a plain step, a tree step, draft masks: all of them)
            depth = K if K and self.tree is None and not (guided and self.draft_masks is not None) else 0
            ctx = FeatureContext(input_ids=ids, features=features, next_ids=next_ids, positions=d["positions"][:T],
                                 meta=meta, last=last, last_seq=last_seq, last_valid=last_valid, start=start,
                                 kv_cap=d["kv_cap"][:meta.seq_lens.shape[0]], depth=depth)
            if not drafting:
                self.drafter.observe(ctx)
            elif guided and self.draft_masks is not None:
                ctx.guide = self.draft_masks
                ctx.guide.begin(tokens, self.compute_stream)
        if drafting:
            tokens, count = self.drafter.propose(ctx)
            tp = self.model.tp
            if tp.world > 1:        # decided once: rank 0's drafts are every rank's
                packed = tp.broadcast(torch.cat([tokens, count[:, None]], dim=1))
                tokens, count = packed[:, :-1], packed[:, -1]
            st.drafts[rows, :tokens.shape[1]] = tokens     # (past them: older drafts, never verified)
            st.draft_count[rows] = count

    @staticmethod
    def next_tokens(slot, ids, tokens, T: int):
        """The token after each of the step's inputs (what a draft head embeds with its feature): the host's
        id (next_ids >= 0), the next input of the step (-1: a token carried on the device), or emitted token
        c of the flattened [S, K + 1] verify output (-2 - c)."""
        src = slot.dev["next_ids"][:T]
        shifted = torch.cat([ids[1:], ids[:1]])
        flat = tokens.flatten() if tokens is not None else ids[:1]
        emitted = flat[(-2 - src).clamp(0, flat.shape[0] - 1)]
        return torch.where(src >= 0, src, torch.where(src == -1, shifted, emitted)).clamp(min=0)
