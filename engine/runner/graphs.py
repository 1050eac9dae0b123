"""CUDA graphs of whole steps: decode steps by (padded batch size, context bound), and steps with prefill
chunks ("mixed") by padded token count. All graphs of both slots share one memory pool: they never run
concurrently (one compute stream), and a step's logits are consumed by its sampling before the next
graph replays.

Decode graph (GraphKey "decode", bs tokens in bs rows, context ctx): carry-over + forward + logits + sampling of
`bs` rows of one query token each,
captured for a bound on the context (`ctx`): the attention's KV split is sized for that bound, so short
contexts do not launch the many mostly idle programs (and merge inputs) that the longest context needs.
Padding rows write no KV (slot -1) and attend to nothing (seq_len 0); their logits are ignored. A speculating
engine also captures quiet decode graphs (drafts False) at the sizes it speculates at: the same step without the
drafting, for a paused engine's plain steps (engine/speculative/plan.py).

Mixed graph ("mixed", T tokens in B rows, the model's context): any step of at most T tokens in at most
B = min(T, max_num_seqs) sequences,
with any query lengths (prefill chunks next to decode rows). The attention grid is sized for one sequence
holding all T tokens; its programs past a sequence's query length exit at once. Padding tokens belong to
no sequence and write no KV; padding sequences have no query tokens; padding logits rows read token 0.
Without these, a step with a prefill chunk is enqueued op by op (several ms of host time for a small
model) while the GPU, a decode step ahead at most, runs dry.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import NamedTuple

import torch

import hostfunc
from engine.runner.slots import DecodeSlot
from engine.runner.step import StepVariant
from engine.sampling.penalties import neutral
from engine.speculative.budget import engine_levels

SHORT_CONTEXT = 512


class GraphKey(NamedTuple):
    """Which captured graph runs a step: its kind and the padded sizes it was captured for. Every row of a
    graph's step samples, so `seqs` is also its sampling rows."""
    kind: str       # "decode" (one query token per row), "spec" (1 + K per row) or "mixed" (any query lengths)
    tokens: int     # query tokens
    seqs: int       # sequences
    context: int    # the bound on a sequence's context that the attention's split is sized for
    drafts: bool = True     # a speculating engine's step drafts for the next one (False: a quiet decode step)

    @property
    def spec_k(self) -> int:
        """Drafts a row of a spec graph verifies (0 for the other kinds)."""
        return self.tokens // self.seqs - 1 if self.kind == "spec" else 0


def graph_batch_sizes(limit: int) -> list[int]:
    """1, 2, 4, 8, every 8 rows to 64, every 16 past it, and the limit: a step pads to the next size, so past 64
    rows at most 15 padding rows (a few percent of such a step) for half the captures."""
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(80, limit + 1, 16), limit]
    return sorted({bs for bs in sizes if bs <= limit})


def graph_token_sizes(limit: int) -> list[int]:
    """Powers of two from 16 to 1024, then steps of 512, and the limit itself."""
    sizes = [16 << i for i in range(7)] + list(range(1536, limit + 1, 512)) + [limit]
    return sorted({t for t in sizes if t <= limit})


def _pad_sampling(h, start: int, end: int) -> None:
    """Sampling rows [start, end) of padding: greedy, so the in-graph sampler reads valid parameters."""
    h["temperature"][start:end] = 0.0
    h["top_k"][start:end] = 0
    h["top_p"][start:end] = 1.0
    h["seeds"][start:end] = 0
    h["steps"][start:end] = 0
    h["smp_row"][start:end] = -1        # no token-pool row: its writes go to the dummy row
    h["forced"][start:end] = -1
    if "pen_row" in h:
        neutral(h, start, end)
    if "smp_shift" in h:
        h["smp_shift"][start:end] = 0
        h["num_drafts"][start:end] = 0


def _pad_tokens(h, start: int, end: int) -> None:
    """Tokens [start, end): id 0 at position 0, writing no KV, carrying nothing."""
    h["input_ids"][start:end] = 0
    h["positions"][start:end] = 0
    h["slot_mapping"][start:end] = -1
    h["carry_src"][start:end] = -1
    h["tok_row"][start:end] = -1
    if "pen_tok" in h:
        h["pen_tok"][start:end] = -1
    if "tok_seq" in h:
        h["tok_seq"][start:end] = 0
        h["shift"][start:end] = 0
        h["next_ids"][start:end] = 0


def _pad_seqs(h, start: int, end: int) -> None:
    h["seq_lens"][start:end] = 0
    if "pen_reset" in h:
        h["pen_reset"][start:end] = -1
    if "seq_shift" in h:
        h["seq_shift"][start:end] = -1
        h["kv_cap"][start:end] = 0


def pad_rows(slot: DecodeSlot, start: int, end: int) -> None:
    """Decode rows [start, end): one padding token over an empty sequence each."""
    h = slot.np
    _pad_tokens(h, start, end)
    _pad_seqs(h, start, end)
    h["logits_indices"][start:end] = range(start, end)
    h["cu_seqlens_q"][start + 1:end + 1] = range(start + 1, end + 1)
    _pad_sampling(h, start, end)


def pad_mixed(slot: DecodeSlot, tokens: int, seqs: int) -> None:
    """Pad a step to `tokens` tokens in `seqs` sequences (see the module docstring)."""
    h, t, b = slot.np, slot.num_tokens, slot.num_seqs
    _pad_tokens(h, t, tokens)
    _pad_seqs(h, b, seqs)
    h["cu_seqlens_q"][b + 1:seqs + 1] = t
    h["logits_indices"][slot.num_sample:seqs] = 0
    _pad_sampling(h, slot.num_sample, seqs)


def pad_spec(slot: DecodeSlot, start: int, end: int, k: int) -> None:
    """Spec rows [start, end): 1 + k padding tokens each over a sequence of 1 + k positions (nothing written,
    finite values read: a query with nothing to attend would be 0 / 0)."""
    h, w = slot.np, k + 1
    _pad_tokens(h, start * w, end * w)
    _pad_seqs(h, start, end)
    h["positions"][start * w:end * w] = list(range(w)) * (end - start)
    h["seq_lens"][start:end] = w
    h["logits_indices"][start:end] = range(start * w, end * w, w)
    h["cu_seqlens_q"][start + 1:end + 1] = range((start + 1) * w, (end + 1) * w, w)
    _pad_sampling(h, start, end)


class StepGraphs:
    """Graphs by (slot, key, variant); variant = (guided, greedy, extras), see engine/runner/step.py. Guided variants
    hold the grammar branch with its host callback node; their hostfunc handles are freed by `close()`.
    Extras variants exist only with `EngineConfig.logprobs` or `penalty_rows` (they double the captures)."""

    def __init__(self, config, max_model_len: int, guided: bool, spec_rows: int = 0):
        self.max_seqs = config.max_num_seqs
        self.max_model_len = max_model_len
        self.spec_levels = engine_levels(config)
        self.tree_k = config.spec_k if config.tuning.spec_tree else 0   # a tree step is never an extras step
        self.spec_sizes = graph_batch_sizes(spec_rows) if spec_rows else []
        self.sizes = graph_batch_sizes(self.max_seqs)
        self.contexts = sorted({min(SHORT_CONTEXT, max_model_len), max_model_len})
        self.token_sizes = graph_token_sizes(config.max_num_batched_tokens)
        self.variants = [StepVariant(g, greedy, lp) for g in ((False, True) if guided else (False,))
                         for greedy in (True, False)
                         for lp in ((False, True) if config.logprobs or config.penalty_rows else (False,))]
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}     # (slot index, GraphKey, StepVariant) ->
        self._execs: dict[tuple, int] = {}     # the same keys -> raw graph exec handles (exec_handle)
        self.replays = Counter()                 # by kind ("decode", "mixed", "guided"); host thread only
        self.callbacks = hostfunc.HostfuncScope()  # handles of the captured grammar callbacks

    def decode_key(self, rows: int, context: int, drafts: bool = True) -> GraphKey:
        return GraphKey("decode", rows, rows, context, drafts)

    def spec_key(self, rows: int, context: int, k: int) -> GraphKey:
        return GraphKey("spec", rows * (k + 1), rows, context)

    def mixed_key(self, tokens: int) -> GraphKey:
        return GraphKey("mixed", tokens, min(tokens, self.max_seqs), self.max_model_len)

    def key_for(self, slot: DecodeSlot) -> GraphKey | None:
        """The graph that runs this step (see the module docstring); None: run it eagerly."""
        context = next(c for c in self.contexts if c >= slot.max_seq_len)
        if slot.spec_k:
            bs = next((b for b in self.spec_sizes if b >= slot.num_seqs), 0)
            return self.spec_key(bs, context, slot.spec_k) if bs and slot.spec_k in self.spec_levels else None
        if slot.max_query_len == 1 and slot.num_sample == slot.num_seqs:
            bs = next((b for b in self.sizes if b >= slot.num_seqs), 0)
            if bs:
                return self.decode_key(bs, context, drafts=not (slot.quiet and bs in self.spec_sizes))
        t = next((t for t in self.token_sizes if t >= slot.num_tokens), 0)
        return self.mixed_key(t) if t else None

    def pad(self, slot: DecodeSlot, key: GraphKey) -> None:
        if key.kind == "decode":
            pad_rows(slot, slot.num_seqs, key.seqs)
        elif key.kind == "spec":
            pad_spec(slot, slot.num_seqs, key.seqs, key.spec_k)
        else:
            pad_mixed(slot, key.tokens, key.seqs)

    @staticmethod
    def padded_seqs(key: GraphKey | None) -> int:
        """Rows of per-sequence inputs (block tables) the graph reads."""
        return 0 if key is None else key.seqs

    def keys(self) -> list[GraphKey]:
        """Every graph, largest first: later captures reuse the pool blocks of earlier ones."""
        mixed = [self.mixed_key(t) for t in reversed(self.token_sizes)]
        spec = [self.spec_key(bs, ctx, k) for k in reversed(self.spec_levels) for bs in reversed(self.spec_sizes)
                for ctx in self.contexts]
        decode = [self.decode_key(bs, ctx, drafts) for bs in reversed(self.sizes) for ctx in self.contexts
                  for drafts in ((True, False) if bs in self.spec_sizes else (True,))]
        return mixed + spec + decode

    def captures(self, key: GraphKey, variant) -> bool:
        """Whether a graph runs this key in this variant: every pair but a draft tree's step with extras (a step
        holding logprobs rows verifies the chain, and penalized rows never speculate: engine/speculative/plan.py)."""
        return not (variant.extras and key.kind == "spec" and key.spec_k == self.tree_k)

    def capture(self, program, slots, compute_stream) -> None:
        """Capture every graph of a StepProgram over both slots and variants (the runner is not kept: no
        runner <-> graphs cycle, so a dropped engine frees its GPU memory at once). Warm-up runs of guided
        variants run their callback on an empty snapshot queue: it reuses the last snapshot, harmlessly."""
        pool, warm = None, set()
        self._execs.clear()
        with torch.cuda.stream(compute_stream), torch.inference_mode():
            for slot in slots:
                prev = slots[1 - slot.index]
                for key in self.keys():
                    for variant in self.variants:
                        if not self.captures(key, variant):
                            continue
                        self.set_empty_step(slot, key)
                        if key not in warm or variant not in warm:  # each shape and each variant once
                            program.step(slot, prev, variant, key)      # warm-up: Triton compiles here
                            warm.update((key, variant))
                        graph = torch.cuda.CUDAGraph()
                        with self.callbacks, torch.cuda.graph(graph, pool=pool, stream=compute_stream):
                            program.step(slot, prev, variant, key)
                        pool = graph.pool()
                        self.graphs[(slot.index, key, variant)] = graph
        compute_stream.synchronize()

    def replay(self, slot: DecodeSlot, variant: tuple) -> float:
        """Replay the slot's step graph; returns the host seconds the replay call took."""
        t0 = time.perf_counter()
        self.graphs[(slot.index, slot.graph_key, variant)].replay()
        host_s = time.perf_counter() - t0
        self._count(slot, variant)
        return host_s

    def exec_handle(self, slot: DecodeSlot, variant: tuple) -> int:
        """The slot's step graph as its raw cudaGraphExec_t, for a native launch that replays it (counted as a
        replay). Valid while the graph is: `capture` and `close` drop the handles with the graphs."""
        key = (slot.index, slot.graph_key, variant)
        handle = self._execs.get(key)
        if handle is None:
            handle = self._execs[key] = self.graphs[key].raw_cuda_graph_exec()
        self._count(slot, variant)
        return handle

    def _count(self, slot: DecodeSlot, variant: tuple) -> None:
        self.replays[slot.graph_key.kind] += 1
        self.replays["guided"] += variant.guided

    def __del__(self):
        self.close()

    def close(self) -> None:
        """Free the captured callbacks once no graph runs any more (synchronize first). A replay of a freed
        callback runs nothing and is recorded as a hostfunc error."""
        self._execs.clear()
        self.graphs.clear()
        try:
            self.callbacks.free()
        except Exception:           # noqa: BLE001 - interpreter teardown: the registry may be gone already
            pass

    def set_empty_step(self, slot: DecodeSlot, key: tuple) -> None:
        """Inputs for capture: every row padding (no KV written, nothing attended), uploaded now."""
        slot.num_tokens = slot.num_seqs = slot.num_sample = 0
        slot.np["cu_seqlens_q"][0] = 0
        self.pad(slot, key)
        slot.num_seqs = StepGraphs.padded_seqs(key)
        slot.upload()
