"""Logprobs of the tokens a request gets, computed inside the step, and their host-side form.

Definition: the log_softmax of the logits the token was chosen from, after penalties, logit_bias and the
grammar mask, before temperature, top-k, top-p and min-p. So a greedy and a sampled request report the same
numbers for the same context, and a token the grammar forbids has no entry. vLLM names two modes: "raw"
(before any processing, penalties included) and "processed" (after all of it, temperature and the filters
included); these sit between the two. With speculation the logits are the target's at the token's position:
every emitted token (accepted drafts, the correction and the bonus token) has the logprob the target gives
it, whatever the drafter proposed.

Device side: `record` is enqueue-only tensor code (log_softmax, gather, topk), run only by the steps whose
graph variant asks for logprobs (engine/runner/step.py). It writes a slot's `logprobs` buffer, [rows, positions,
1 + 2 * MAX_LOGPROBS] float32 per sampling row and position: the token's logprob, the top MAX_LOGPROBS
logprobs, then their token ids stored as int32 bits. The buffer comes back beside the sampled tokens, on the
same stream and event (engine/runner/slots.py download_sampled).
"""
from __future__ import annotations

import torch

from engine.sampling.limits import MAX_LOGPROBS

ENTRY_WIDTH = 1 + 2 * MAX_LOGPROBS  # floats per (sampling row, position) in a slot's buffer

Entry = tuple[float, list[tuple[int, float]]]     # (the token's logprob, [(token id, logprob), ...] best first)


def record(out: torch.Tensor, logits: torch.Tensor, tokens: torch.Tensor) -> None:
    """out [R, P, 1 + 2 * MAX_LOGPROBS] float32; logits [R * P, V], processed as the tokens were chosen from
    them; tokens [R, P] int64 (PAD / NO_TOKEN allowed where no token was emitted: their entries are unread)."""
    rows, positions = tokens.shape
    top = min(MAX_LOGPROBS, logits.shape[-1])
    lp = torch.log_softmax(logits.float(), dim=-1)
    vals, ids = lp.topk(top, dim=-1)
    out[:, :, 0] = lp.gather(1, tokens.reshape(-1, 1).clamp(min=0)).view(rows, positions)
    out[:, :, 1:1 + top] = vals.view(rows, positions, top)
    out[:, :, 1 + MAX_LOGPROBS:1 + MAX_LOGPROBS + top].view(torch.int32).copy_(ids.view(rows, positions, top))


class HostLogprobs:
    """A step's logprobs as the host reads them (one `tolist` each of values and ids)."""

    def __init__(self, host: torch.Tensor, rows: int, vocab: int):
        top = min(MAX_LOGPROBS, vocab)
        self.values = host[:rows, :, :1 + top].tolist()
        self.ids = host[:rows, :, 1 + MAX_LOGPROBS:1 + MAX_LOGPROBS + top].view(torch.int32).tolist()

    def entries(self, row: int, count: int, top_n: int) -> list[Entry]:
        """Sampling row `row`'s first `count` positions, each with its top `top_n` (tokens a grammar forbids,
        at -inf, left out)."""
        out = []
        for values, ids in zip(self.values[row][:count], self.ids[row][:count]):
            top = [(i, v) for i, v in zip(ids[:top_n], values[1:top_n + 1]) if v != float("-inf")]
            out.append((values[0], top))
        return out
