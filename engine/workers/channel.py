"""Step messages from rank 0 to the other ranks, on the control group (gloo, CPU tensors).

A message is a fixed header (which slot, the step's variant, graph key and sizes) and then the bytes of the
slot's host buffer that the step reads (engine/runner/slots.py: every input field and the used block-table rows,
graph padding included), received straight into the worker's own slot. A worker then launches the same step
on its shard: same graph, same inputs, same collectives in the same order.
"""
from __future__ import annotations

import torch

from engine.runner.graphs import GraphKey, StepGraphs

STOP, STEP = 0, 1
_KINDS = (None, "decode", "mixed", "spec")
_SIZES = ("num_tokens", "num_seqs", "num_sample", "num_carry", "spec_k", "quiet", "max_query_len", "max_seq_len",
          "extras")


class StepChannel:
    def __init__(self, group):
        self.group = group
        self.header = torch.zeros(11 + len(_SIZES), dtype=torch.int64)
        self._header_np = self.header.numpy()

    # ---- rank 0 ------------------------------------------------------------------------------
    def publish(self, slot, step_index: int, greedy: bool, guided: bool) -> None:
        key = slot.graph_key or GraphKey(None, 0, 0, 0)
        nbytes = slot.input_bytes(StepGraphs.padded_seqs(slot.graph_key))
        sizes = [getattr(slot, name) for name in _SIZES]
        self._header_np[:] = [STEP, slot.index, step_index, greedy, guided, _KINDS.index(key.kind), key.tokens,
                              key.seqs, key.context, key.drafts, nbytes, *sizes]
        self.group.control_broadcast(self.header)
        self.group.control_broadcast(slot.inputs(nbytes))

    def stop(self) -> None:
        self.header.zero_()
        self.group.control_broadcast(self.header)

    # ---- workers -----------------------------------------------------------------------------
    def receive(self, slots, before_write) -> tuple | None:
        """The next step -> (slot, step index, greedy, guided), its inputs written into the slot's host
        buffer; None: stop. `before_write(slot)` waits until the slot's previous inputs went up."""
        h = self.group.control_broadcast(self.header).tolist()
        if h[0] == STOP:
            return None
        _, index, step_index, greedy, guided, kind, tokens, seqs, context, drafts, nbytes, *sizes = h
        slot = slots[index]
        before_write(slot)
        self.group.control_broadcast(slot.inputs(nbytes))
        for name, value in zip(_SIZES, sizes):
            setattr(slot, name, value)
        slot.graph_key = GraphKey(_KINDS[kind], tokens, seqs, context, bool(drafts)) if kind else None
        return slot, step_index, bool(greedy), bool(guided)
