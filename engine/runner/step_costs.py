"""What a speculating engine's steps cost on this GPU: each captured graph of a level of K (and the quiet plain step,
K = 0) at each batch size it speculates at, timed once after capture, for the draft budget
(engine/speculative/budget.py).

Each graph replays over padding rows made to look like real ones: every row at the short context bound (its
attention reads that many tokens of KV, from pages of its own) and writing no KV (slot -1), greedy and unguided.
The step's KV reads and matmuls are those of a real step of that size, so the ratios between levels are too.
"""
from __future__ import annotations

import torch

from engine.runner.step import StepVariant

REPLAYS = 5


def time_steps(graphs, slot, compute_stream, num_blocks: int, block_size: int) -> dict:
    """{(K, padded rows): median seconds a step} for K = 0 and every level, at every spec batch size."""
    variant = StepVariant(False, True, False)
    context = graphs.contexts[0]
    costs = {}
    with torch.cuda.stream(compute_stream), torch.inference_mode():
        for rows in graphs.spec_sizes:
            for k in (0, *graphs.spec_levels):
                # a paused engine's plain steps are quiet ones (engine/speculative/plan.py)
                key = graphs.spec_key(rows, context, k) if k else graphs.decode_key(rows, context, drafts=False)
                graph = graphs.graphs.get((slot.index, key, variant))
                if graph is None:
                    continue
                graphs.set_empty_step(slot, key)
                _look_real(slot, rows, k + 1, context, num_blocks, block_size)
                costs[(k, rows)] = _median_seconds(graph, compute_stream)
    return costs


def _look_real(slot, rows: int, width: int, context: int, num_blocks: int, block_size: int) -> None:
    """Padding rows of `width` query tokens each, over `context` tokens of KV on distinct pages."""
    h = slot.np
    pages = -(-context // block_size)
    for r in range(rows):
        h["seq_lens"][r] = context
        h["positions"][r * width:(r + 1) * width] = range(context - width, context)
        h["block_tables"][r, :pages] = [(r * pages + j) % num_blocks for j in range(pages)]
    slot.upload()


def _median_seconds(graph, stream) -> float:
    graph.replay()                                  # warm: the inputs' copy, caches
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        graph.replay()
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]
