"""DecodeSlot: every buffer one step reads or writes, allocated once, with pinned host mirrors.

The CPU fills the host side, `upload` copies the used prefix of each buffer to the device (on the
input-copy stream), the step runs on the device side, and the sampled tokens come back into
`sampled_host`. A slot is reused only after the commit that read its results (two slots, ping-pong).

Carry-over: a token sampled by an earlier step but not yet seen by the host is an input of this step. Its
input id is a placeholder; `carry_src[t]` says where the device takes it from before the forward: -1 the host's
id stands, 0 the last token of token-pool row `tok_row[t]`, j >= 1 that row's draft j (engine/memory/token_pool.py).
Each sampling row writes its token to pool row `smp_row[s]`. Plain and speculative steps read these fields
the same way.
"""
from __future__ import annotations

import math

import torch

from engine.sampling.logprobs import ENTRY_WIDTH
from engine.sampling.limits import MAX_STOPS

_FIELDS = {  # name -> (dtype, shape key)
    "input_ids": (torch.int64, "tokens"), "positions": (torch.int64, "tokens"),
    "slot_mapping": (torch.int64, "tokens"), "carry_src": (torch.int64, "tokens"),
    "cu_seqlens_q": (torch.int32, "seqs+1"), "seq_lens": (torch.int32, "seqs"),
    "logits_indices": (torch.int64, "seqs"), "temperature": (torch.float32, "seqs"),
    "top_k": (torch.int64, "seqs"), "top_p": (torch.float32, "seqs"), "seeds": (torch.int64, "seqs"),
    "steps": (torch.int64, "seqs"), "tok_row": (torch.int64, "tokens"), "smp_row": (torch.int64, "seqs"),
    "forced": (torch.int64, "seqs"),
}
# With speculation (speculative/): whether the host planned a token / sequence / sampling row as if the sequence's
# in-flight drafts were all accepted (shift, smp_shift; seq_shift: its pool row, or -1: the device corrects them),
# each token's row in the step (for its block table), each sampling row's draft cap, the token after each input
# (for a draft head: engine/runner/spec_step.py next_tokens) and the tokens each sequence's pages hold.
_SPEC_FIELDS = {
    "tok_seq": (torch.int64, "tokens"), "shift": (torch.int64, "tokens"),
    "seq_shift": (torch.int64, "seqs"), "smp_shift": (torch.int64, "seqs"),
    "num_drafts": (torch.int64, "seqs"), "next_ids": (torch.int64, "tokens"), "kv_cap": (torch.int64, "seqs"),
}

# With penalties (engine/sampling/penalties.py): each token's penalty row and kind, the rows to zero, each sampling
# row's parameters and the ids min_tokens masks. Written only for steps with `extras` (graph padding always).
_PENALTY_FIELDS = {
    "pen_tok": (torch.int64, "tokens"), "pen_reset": (torch.int64, "seqs"), "pen_row": (torch.int64, "seqs"),
    "presence": (torch.float32, "seqs"), "frequency": (torch.float32, "seqs"), "repetition": (torch.float32, "seqs"),
    "min_p": (torch.float32, "seqs"), "min_tokens": (torch.int64, "seqs"), "stop_ids": (torch.int64, "stops"),
}


def _view(buf: torch.Tensor, offset: int, dtype: torch.dtype, shape) -> torch.Tensor:
    n = math.prod(shape) * dtype.itemsize
    return buf[offset:offset + n].view(dtype).view(shape)


class DecodeSlot:
    def __init__(self, index: int, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device,
                 spec_k: int = 0, logprobs: bool = False, penalties: bool = False):
        self.index = index
        self.device = device
        pin = device.type == "cuda"
        sizes = {"tokens": (max_tokens,), "seqs": (max_seqs,), "seqs+1": (max_seqs + 1,),
                 "stops": (max_seqs, MAX_STOPS)}
        # One pinned buffer, one device buffer, every field a typed view at the same offset in both: a step's
        # inputs go up in a single copy. Block tables come last so the copy can stop after the used rows.
        layout, offset = [], 0
        fields = _FIELDS | (_SPEC_FIELDS if spec_k else {}) | (_PENALTY_FIELDS if penalties else {})
        for name, (dtype, key) in fields.items():
            layout.append((name, dtype, sizes[key], offset))
            offset += -(-math.prod(sizes[key]) * dtype.itemsize // 8) * 8
        self._bt_offset, self._bt_row = offset, max_blocks * 4
        layout.append(("block_tables", torch.int32, (max_seqs, max_blocks), offset))
        self._host_buf = torch.zeros(offset + max_seqs * self._bt_row, dtype=torch.uint8, pin_memory=pin)
        self._dev_buf = self._host_buf.to(device) if pin else self._host_buf
        self.host = {n: _view(self._host_buf, o, dt, sh) for n, dt, sh, o in layout}
        self.dev = {n: _view(self._dev_buf, o, dt, sh) for n, dt, sh, o in layout}
        self.host["carry_src"].fill_(-1)
        self.dev["carry_src"].fill_(-1)
        self.sampled = torch.zeros(max_seqs, dtype=torch.int64, device=device)
        self.sampled_host = torch.zeros(max_seqs, dtype=torch.int64, pin_memory=pin)
        self.np = {name: t.numpy() for name, t in self.host.items()}   # fast element writes
        # speculation: each sampling row's emitted tokens (PAD after them), then the drafts it verified
        self.spec_k = 0                                                 # drafts verified per row this step
        self.quiet = False                                              # a speculating engine's step drafts nothing
        self.spec_out = torch.zeros(max_seqs, spec_k + 2, dtype=torch.int64, device=device) if spec_k else None
        self.spec_out_host = torch.zeros(max_seqs, spec_k + 2, dtype=torch.int64, pin_memory=pin) if spec_k \
            else None
        # logprobs of each sampling row's tokens at each scored position (engine/sampling/logprobs.py), filled and read
        # back only by steps that ask for them (`want_logprobs`)
        shape = (max_seqs, spec_k + 1, ENTRY_WIDTH)
        self.logprobs = torch.zeros(shape, dtype=torch.float32, device=device) if logprobs else None
        self.logprobs_host = torch.zeros(shape, dtype=torch.float32, pin_memory=pin) if logprobs else None
        self.want_logprobs = False
        self.all_greedy = True                                          # every sampling row greedy (rows.py)
        self.guided_rows = False                                        # a sampling row is guided
        self.extras = False                                             # logprobs / penalties: engine/runner/step.py
        self.bias_writes = []                                           # logit_bias rows set before the step
        self.span_writes = []                                           # penalty counts of cached prefixes
        self.history_writes = []                                        # n-gram history of cached prefixes
        self.vocab_writes = None                                        # the draft vocabulary's spare rows
        self.num_tokens = self.num_seqs = self.num_sample = 0
        self.max_query_len = self.max_seq_len = 0
        self.num_carry = 0                                              # tokens taken from the previous step
        self.graph_key = None                                           # which graph runs it (None: eager)
        self.rows = []                                                  # ScheduledRows of this step
        self.bt_rows = [(None, 0)] * max_seqs                          # (block table, pages) each row holds
        self.marks = None                                               # timing events recorded inside the step
        # (device, host) buffers of a step's results, a row per sampling row: the tokens (spec_out with
        # speculation), then the logprobs, read back only where the step asked for them (`want_logprobs`)
        tokens = (self.spec_out, self.spec_out_host) if spec_k else (self.sampled, self.sampled_host)
        self._result_bufs = [tokens] + ([(self.logprobs, self.logprobs_host)] if logprobs else [])
        # what a native launch copies, resolved once: the upload's (device, host) and each result's (host,
        # device, bytes a row)
        self._raw_upload = (self._dev_buf.data_ptr(), self._host_buf.data_ptr())
        self._raw_results = [(dst.data_ptr(), src.data_ptr(), dst.stride(0) * dst.element_size())
                             for src, dst in self._result_bufs]

    def upload(self, padded: int = 0) -> None:
        """Copy the step's inputs host -> device on the current stream in one copy (no-op on the CPU);
        `padded` rows for graphs. The host side must stay untouched until the copy ran."""
        if self.device.type != "cuda":
            return
        end = self.input_bytes(padded)
        self._dev_buf[:end].copy_(self._host_buf[:end], non_blocking=True)

    def input_bytes(self, padded: int = 0) -> int:
        """Bytes of the host buffer the step reads: every field, then the used rows of the block tables."""
        return self._bt_offset + max(self.num_seqs, padded) * self._bt_row

    def inputs(self, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of the host buffer (uint8): what a tensor-parallel step message carries."""
        return self._host_buf[:nbytes]

    def download_sampled(self) -> None:
        n = self.num_sample
        for src, dst in self._result_bufs[:1 + self.want_logprobs]:
            if self.device.type == "cuda":
                dst[:n].copy_(src[:n], non_blocking=True)
            else:
                dst[:n] = src[:n]

    def raw_copies(self, padded: int = 0) -> tuple:
        """The copies of `upload` and `download_sampled` as raw (dst, src, bytes): (upload, [downloads]), for a
        native launch (engine/runner/native_launch.py; CUDA only)."""
        n = self.num_sample
        return (*self._raw_upload, self.input_bytes(padded)), [
            (dst, src, n * row_bytes) for dst, src, row_bytes in self._raw_results[:1 + self.want_logprobs]]
