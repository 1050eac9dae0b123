"""CUDA graphs of the decode step: one per (slot, padded batch size), all in one memory pool.

A graph holds carry-over + forward + logits for `bs` rows of one query token each, captured for a bound
on the context (`ctx`): the attention's KV split is sized for that bound, so short contexts do not launch
the many mostly idle programs (and merge inputs) that the longest context needs. Graphs of both slots
share one pool: they never run concurrently (one compute stream), and a step's logits are consumed by
its sampling before the next graph replays. Padding rows (from the real batch up to `bs`) write no KV
(slot -1) and attend to nothing (seq_len 0); their logits are ignored.
"""
from __future__ import annotations

import torch

from engine.slots import DecodeSlot


def graph_batch_sizes(limit: int) -> list[int]:
    return sorted({bs for bs in [1, 2, 4, 8, *range(16, limit + 1, 8), limit] if bs <= limit})


def pad_rows(slot: DecodeSlot, start: int, end: int) -> None:
    """Rows [start, end): one query token over an empty sequence, writing no KV, carrying nothing."""
    h = slot.np
    h["input_ids"][start:end] = 0
    h["positions"][start:end] = 0
    h["slot_mapping"][start:end] = -1
    h["carry_src"][start:end] = -1
    h["seq_lens"][start:end] = 0
    h["logits_indices"][start:end] = range(start, end)
    h["cu_seqlens_q"][start + 1:end + 1] = range(start + 1, end + 1)


SHORT_CONTEXT = 512


class DecodeGraphs:
    def __init__(self, runner):
        self.runner = runner
        self.sizes = graph_batch_sizes(runner.config.max_num_seqs)
        self.contexts = sorted({min(SHORT_CONTEXT, runner.max_model_len), runner.max_model_len})
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def size_for(self, slot: DecodeSlot) -> tuple[int, int]:
        """(padded batch size, context bound) of the graph that runs this step; (0, 0): run it eagerly."""
        if slot.max_query_len != 1 or slot.num_sample != slot.num_seqs:
            return 0, 0
        bs = next((b for b in self.sizes if b >= slot.num_seqs), 0)
        return (bs, next(c for c in self.contexts if c >= slot.max_seq_len)) if bs else (0, 0)

    def capture(self) -> None:
        r = self.runner
        limit = self.sizes[-1]
        pool = None
        with torch.cuda.stream(r.compute_stream), torch.inference_mode():
            for slot in r.slots:
                pad_rows(slot, 0, limit)
                slot.np["cu_seqlens_q"][0] = 0
                slot.num_tokens = slot.num_seqs = limit
                slot.upload()
                for bs in reversed(self.sizes):       # largest first: later graphs reuse its pool blocks
                    for ctx in self.contexts:
                        r.decode_logits(slot, bs, ctx)    # warm-up: Triton compiles here
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, pool=pool, stream=r.compute_stream):
                            logits = r.decode_logits(slot, bs, ctx)
                        pool = graph.pool()
                        self.graphs[(slot.index, bs, ctx)] = (graph, logits)
        r.compute_stream.synchronize()

    def replay(self, slot: DecodeSlot) -> torch.Tensor:
        graph, logits = self.graphs[(slot.index, slot.graph_bs, slot.graph_ctx)]
        graph.replay()
        return logits[:slot.num_sample]
