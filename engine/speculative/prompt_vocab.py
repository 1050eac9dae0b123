"""The draft vocabulary's spare rows, lent to the tokens of recent prompts that its ranking leaves out.

EAGLE drafts come from the LM-head rows of the ranking's first ids (Tuning.spec_draft_vocab_size): a
draft step reads those rows, not the whole vocabulary. A tool call copies its schema's rare tokens (a property
name, an enum value) from the prompt, and a ranking of typical answers leaves many of them out, so the head could
never draft them. `spec_prompt_vocab` more rows follow the ranked ones. They start as the next ranked ids, and
each admitted request's prompt tokens outside the ranked ones, and a guided request's guide text
(GuidedRequest.guide_ids), take the rows used least recently (host only here;
PagedHead.write_vocab copies the ids and their LM-head rows on the compute stream before the step that follows).

A row always holds one id whose LM-head row it carries, and no id is in two rows: the argmax and top-k over the
rows see each token once, and a replaced row changes only which token a draft may be, never an output.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np


def spare_ids(ranked: list[int], base: int, count: int, vocab: int) -> list[int]:
    """`count` ids to start the spare rows with: the ranking's after its first `base`, then the lowest ids it
    does not hold."""
    spare = list(ranked[base:base + count])
    if len(spare) < count:
        held = set(ranked[:base]) | set(spare)
        spare += [t for t in range(vocab) if t not in held][:count - len(spare)]
    return spare


class PromptVocab:
    """The spare rows after the `base` ranked ones (rows base .. base + len(spare) - 1), least recently used
    first. Loop thread only."""

    def __init__(self, ranked: list[int], spare: list[int], vocab: int):
        self.base = len(ranked)
        self.known = np.zeros(vocab, dtype=bool)          # ids of the ranked rows: never lent a spare one
        self.known[np.asarray(ranked, dtype=np.int64)] = True
        self.rows: OrderedDict[int, int] = OrderedDict((t, self.base + i) for i, t in enumerate(spare))

    @property
    def capacity(self) -> int:
        return len(self.rows)

    def admit(self, prompt, writes: dict[int, int]) -> None:
        """A request's prompt: its ids outside the ranked rows take spare rows (at most all of them), those
        already held become the most recent. `writes` gets {row: id} for each row that changed."""
        ids = np.unique(np.asarray(prompt, dtype=np.int64))
        ids = ids[(ids >= 0) & (ids < len(self.known))]
        novel = ids[~self.known[ids]].tolist()[:self.capacity]
        for token in novel:
            if token in self.rows:
                self.rows.move_to_end(token)
        for token in novel:
            if token not in self.rows:
                _, row = self.rows.popitem(last=False)
                self.rows[token] = row
                writes[row] = token

    def ids(self) -> list[int]:
        """The id each spare row holds, in row order."""
        return [t for t, _ in sorted(self.rows.items(), key=lambda item: item[1])]
