"""Presence, frequency and repetition penalties, min_p and min_tokens: per-row device state and the step's code.

Semantics:
- presence_penalty / frequency_penalty (OpenAI): logit -= presence * [count > 0] + frequency * count, over the
  request's output tokens;
- repetition_penalty (vLLM / transformers): a token seen in the prompt or the output has its logit divided by it
  when positive, multiplied by it when negative (applied first);
- min_p: after temperature, top-k and top-p, tokens with probability below min_p times the top one's are dropped
  (engine/sampling/sampler.py);
- min_tokens: EOS and the stop token ids are masked until the request has that many output tokens;
- logit_bias (OpenAI): each listed token's bias is added to its logit, after the penalties.
Logprobs (engine/sampling/logprobs.py) see the penalized logits.

State: a penalized request (presence, frequency or repetition set) takes a row of `PenaltyState` from a bounded pool
(`engine.memory.row_pool.RowPool` on `seq.pen_row`, handed out with its pages at admission, like a speculation row;
admission waits while the pool is empty). The row holds the request's output token counts and its prompt's tokens.
It is built from the step's *inputs*: every token of a sequence enters some step as an input exactly once (prompt
chunks, then each emitted token as the next step's input, carried over on the device), so before a step samples, its
row counts every token up to the last input. A row whose chunk starts at position 0 (a new request, or a preempted
one recomputing) is zeroed first, in the step, so a new owner never reads an old owner's counts and no host copy is
needed. A request that mapped cached pages (engine/memory/block_manager.py) starts past position 0: its row is set
to the counts of its cached prefix instead (`write_span`, before its first step, as the bias below). A row also
holds the request's logit_bias as a dense row of the vocabulary: it is written when the row's first chunk is
prepared (`bias_writes`), outside the step but on the compute stream ahead of the step that first reads it, so an
earlier step that still reads the row's previous owner is done before it changes. Penalized requests do not
speculate: a spec step's inputs hold drafts that may be rejected, and rejection sampling would need the penalized
distribution at every draft position (engine steps with any penalized row do not speculate at all;
engine/speculative/plan.py).

All of it runs only in steps whose variant has `extras` (engine/runner/step.py): no kernel for steps without such rows.
"""
from __future__ import annotations

import torch


class PenaltyState:
    def __init__(self, num_rows: int, vocab: int, device: torch.device):
        self.num_rows, self.vocab, self.dummy = num_rows, vocab, num_rows     # padding / unpenalized rows -> dummy
        self.counts = torch.zeros(num_rows + 1, vocab, dtype=torch.int32, device=device)
        self.prompt = torch.zeros(num_rows + 1, vocab, dtype=torch.bool, device=device)
        self.bias = torch.zeros(num_rows + 1, vocab, dtype=torch.float32, device=device)

    def write_bias(self, writes: list) -> None:
        """[(row, ((token id, bias), ...) or None)]: each row's bias replaced, on the current stream (the
        compute stream, in the order of the steps)."""
        rows = torch.tensor([row for row, _ in writes], dtype=torch.int64)
        pairs = [(row, t, b) for row, bias in writes for t, b in bias or ()]
        flat = torch.tensor([row * self.vocab + t for row, t, _ in pairs], dtype=torch.int64)
        vals = torch.tensor([b for _, _, b in pairs], dtype=torch.float32)
        rows, flat, vals = (to_device(x, self.bias.device) for x in (rows, flat, vals))
        self.bias.index_fill_(0, rows, 0.0)
        self.bias.view(-1).index_copy_(0, flat, vals)

    def write_span(self, writes: list) -> None:
        """[(row, prompt tokens, output tokens)]: each row's counts and prompt marks set to those of a cached
        prefix (a request that mapped cached pages: no step of its own sees those tokens), replacing the last
        owner's, on the current stream ahead of the step that first reads them (as `write_bias`)."""
        rows = torch.tensor([row for row, _, _ in writes], dtype=torch.int64)
        marks = torch.tensor([row * self.vocab + t for row, prompt, _ in writes for t in prompt], dtype=torch.int64)
        outs = torch.tensor([row * self.vocab + t for row, _, out in writes for t in out], dtype=torch.int64)
        rows, marks, outs = (to_device(x, self.counts.device) for x in (rows, marks, outs))
        self.counts.index_fill_(0, rows, 0)
        self.prompt.index_fill_(0, rows, False)
        self.prompt.view(-1).index_fill_(0, marks, True)
        self.counts.view(-1).index_add_(0, outs, torch.ones_like(outs, dtype=torch.int32))

    def rows(self, host_rows: torch.Tensor) -> torch.Tensor:
        return torch.where(host_rows >= 0, host_rows, self.dummy)

    def observe(self, d: dict, ids: torch.Tensor, T: int, B: int) -> None:
        """Zero the rows whose chunk starts at 0 (and the dummy), then count the step's input tokens `ids` [T]:
        d["pen_tok"][t] = 2 * row + (1 if token t is an output token else 0), -1 for no row."""
        reset = torch.cat([self.rows(d["pen_reset"][:B]), self.counts.new_full((1,), self.dummy, dtype=torch.int64)])
        # index_fill_ with a Python scalar: indexed assignment (`t[idx] = 0`) copies a CPU tensor, which a
        # graph capture refuses
        self.counts.index_fill_(0, reset, 0)
        self.prompt.index_fill_(0, reset, False)
        tok = d["pen_tok"][:T]
        row = self.rows(torch.where(tok >= 0, tok // 2, -1))
        is_out = (tok >= 0) & (tok % 2 == 1)
        flat = torch.where(is_out, row, self.dummy) * self.vocab + ids
        self.counts.view(-1).index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        self.prompt.view(-1).index_fill_(0, torch.where((tok >= 0) & ~is_out, row, self.dummy) * self.vocab + ids, True)

    def apply(self, logits: torch.Tensor, d: dict, rows: int) -> None:
        """Penalties and min_tokens on `logits` [rows, V] in place (sampling rows' parameters in `d`)."""
        r = self.rows(d["pen_row"][:rows])
        counts = self.counts[r]
        out = counts > 0
        rep = d["repetition"][:rows, None]
        seen = out | self.prompt[r]
        logits.copy_(torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits))
        logits.sub_(d["frequency"][:rows, None] * counts + d["presence"][:rows, None] * out)
        logits.add_(self.bias[r])
        stops = d["stop_ids"][:rows]
        active = (stops >= 0) & (d["steps"][:rows, None] < d["min_tokens"][:rows, None])
        ban = torch.zeros(rows, self.vocab + 1, dtype=torch.bool, device=logits.device)
        ban.scatter_(1, torch.where(active, stops, self.vocab), True)
        logits.masked_fill_(ban[:, :self.vocab], float("-inf"))


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, copied on the current stream."""
    # pinned, so the copy is ordered on the stream without a host wait (the caching host allocator keeps the
    # page alive until the copy ran)
    return x.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else x


def span(seq, end: int) -> tuple[list[int], list[int]]:
    """(prompt tokens, output tokens) of positions [0, end): a preempted request's cached prefix may hold outputs."""
    prompt = len(seq.prompt_token_ids)
    return seq.tokens(0, min(end, prompt)), seq.tokens(prompt, end) if end > prompt else []


def fill_tokens(h, row, t: int) -> None:
    """pen_tok of a row's tokens [t, t + n) (see PenaltyState.observe) and its reset flag."""
    seq, n, start = row.seq, row.num_tokens, row.start
    if seq.pen_row < 0:
        h["pen_tok"][t:t + n] = -1
        return
    prompt = len(seq.prompt_token_ids)
    base = 2 * seq.pen_row
    if n == 1:
        h["pen_tok"][t] = base + (start >= prompt)
    else:
        h["pen_tok"][t:t + n] = [base + (p >= prompt) for p in range(start, start + n)]


def fill_sampling(h, s: int, seq, stops: tuple[int, ...]) -> None:
    """Sampling row s's parameters; `stops`: the ids min_tokens masks (EOS unless ignored, stop token ids)."""
    p = seq.params
    h["pen_row"][s] = seq.pen_row
    h["presence"][s] = p.presence_penalty
    h["frequency"][s] = p.frequency_penalty
    h["repetition"][s] = p.repetition_penalty
    h["min_p"][s] = p.min_p
    h["min_tokens"][s] = p.min_tokens
    h["stop_ids"][s] = -1
    if p.min_tokens:
        h["stop_ids"][s, :len(stops)] = stops


def neutral(h, start: int, end: int) -> None:
    """Sampling rows [start, end) without penalties (padding, or rows of requests that set none)."""
    h["pen_row"][start:end] = -1
    h["presence"][start:end] = 0.0
    h["frequency"][start:end] = 0.0
    h["repetition"][start:end] = 1.0
    h["min_p"][start:end] = 0.0
    h["min_tokens"][start:end] = 0
    h["stop_ids"][start:end] = -1
