"""DecodeSlot: every buffer one step reads or writes, allocated once, with pinned host mirrors.

The CPU fills the host side, `upload` copies the used prefix of each buffer to the device (on the
input-copy stream), the step runs on the device side, and the sampled tokens come back into
`sampled_host`. A slot is reused only after the commit that read its results (two slots, ping-pong).

Carry-over: a token sampled by the previous step but not yet seen by the host is an input of this step.
Its input id is a placeholder; `carry_src[t]` names the row of the previous slot's `sampled` buffer to
take it from (-1: the host's id stands), and the device fills it in before the forward.
"""
from __future__ import annotations

import torch

_FIELDS = {  # name -> (dtype, shape key)
    "input_ids": (torch.int64, "tokens"), "positions": (torch.int64, "tokens"),
    "slot_mapping": (torch.int64, "tokens"), "carry_src": (torch.int64, "tokens"),
    "cu_seqlens_q": (torch.int32, "seqs+1"), "seq_lens": (torch.int32, "seqs"),
    "logits_indices": (torch.int64, "seqs"), "temperature": (torch.float32, "seqs"),
    "top_k": (torch.int64, "seqs"), "top_p": (torch.float32, "seqs"), "seeds": (torch.int64, "seqs"),
    "steps": (torch.int64, "seqs"),
}


class DecodeSlot:
    def __init__(self, index: int, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device):
        self.index = index
        self.device = device
        pin = device.type == "cuda"
        sizes = {"tokens": (max_tokens,), "seqs": (max_seqs,), "seqs+1": (max_seqs + 1,)}
        self.host, self.dev = {}, {}
        for name, (dtype, key) in _FIELDS.items():
            self.host[name] = torch.zeros(sizes[key], dtype=dtype, pin_memory=pin)
        self.host["carry_src"].fill_(-1)
        self.host["block_tables"] = torch.zeros((max_seqs, max_blocks), dtype=torch.int32, pin_memory=pin)
        for name, t in self.host.items():
            self.dev[name] = t.to(device) if pin else t
        self.sampled = torch.zeros(max_seqs, dtype=torch.int64, device=device)
        self.sampled_host = torch.zeros(max_seqs, dtype=torch.int64, pin_memory=pin)
        self.np = {name: t.numpy() for name, t in self.host.items()}   # fast element writes
        self.num_tokens = self.num_seqs = self.num_sample = 0
        self.max_query_len = self.max_seq_len = 0
        self.num_carry = 0                                              # tokens taken from the previous step
        self.graph_bs = 0                                               # padded size if a graph runs it
        self.rows = []                                                  # ScheduledRows of this step

    def upload(self, padded: int = 0) -> None:
        """Copy the used prefix of every field host -> device on the current stream (no-op on the CPU);
        `padded` rows for graphs. The host side must stay untouched until the copy ran."""
        if self.device.type != "cuda":
            return
        tokens, seqs = max(self.num_tokens, padded), max(self.num_seqs, padded)
        used = {"tokens": tokens, "seqs": seqs, "seqs+1": seqs + 1}
        for name, (_, key) in _FIELDS.items():
            n = used[key]
            self.dev[name][:n].copy_(self.host[name][:n], non_blocking=True)
        self.dev["block_tables"][:seqs].copy_(self.host["block_tables"][:seqs], non_blocking=True)

    def download_sampled(self) -> None:
        n = self.num_sample
        if self.device.type == "cuda":
            self.sampled_host[:n].copy_(self.sampled[:n], non_blocking=True)
        else:
            self.sampled_host[:n] = self.sampled[:n]
