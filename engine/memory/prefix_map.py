"""The scheduler's side of prefix caching: a sequence's page digests, the cached pages of its prefix mapped on
admission, its full prompt pages registered as their steps launch and the pages of its outputs as it gives its
pages back (the registry of cached pages is engine/memory/block_manager.py's). No other request can use an
output page while its sequence runs (no prompt holds those tokens yet), and registering a page costs a digest
and a lookup: done once a sequence for all its output pages, not once a decode step for each.

A sequence's `block_digests` grow as its tokens become known, each chained over every token up to its page's
end; `num_registered` counts its pages already registered. A mapped page counts as computed: an admitted
sequence starts computing after its cached prefix, of which one token at least is left to compute.
"""
from __future__ import annotations

from engine.memory.block_manager import ROOT, BlockManager, prefix_digests


class PrefixMap:
    def __init__(self, blocks: BlockManager):
        self.blocks = blocks
        self.cache_penalized = True     # penalized requests map cached pages (their counts are written for them)

    def match(self, seq) -> int:
        """Map the cached pages of the sequence's longest known prefix (a waiting sequence holds no pages);
        returns the tokens they hold, which count as computed."""
        if not self._may_match(seq):
            return 0
        usable = self._usable_pages(seq)
        self._digest_pages(seq, usable)
        seq.block_table = self.blocks.match(seq.block_digests[:usable])
        seq.num_registered = len(seq.block_table)
        seq.num_computed_tokens = len(seq.block_table) * self.blocks.block_size
        return seq.num_computed_tokens

    def _usable_pages(self, seq) -> int:
        """Full pages a waiting sequence may map: at least one token is left to compute."""
        return (seq.num_tokens - 1) // self.blocks.block_size

    def _may_match(self, seq) -> bool:
        return self.blocks.caching and (self.cache_penalized or not seq.params.penalty_row)

    def next_page_uncached(self, seq) -> bool:
        """Whether the prefix cache mapped fewer of the sequence's full prompt pages than it could hold."""
        return self._may_match(seq) and len(seq.block_table) < self._usable_pages(seq)

    def computing(self, rows) -> set[bytes]:
        """Digests of every page these rows compute in their step (a decode row completes none: row_pages)."""
        return {d for row in rows if row.num_tokens > 1 for d in self.row_pages(row)}

    def row_pages(self, row) -> list[bytes]:
        """Digests of the full pages whose KV the row computes (tokens the host knows, not yet registered)."""
        seq, bs = row.seq, self.blocks.block_size
        full = min(seq.num_tokens, row.start + row.num_tokens) // bs
        if row.num_tokens <= 1 or full <= row.start // bs:
            return []               # a decode row: its page fills with a token still in flight
        self._digest_pages(seq, full)
        return seq.block_digests[row.start // bs:full]

    def unmatch(self, seq) -> None:
        """Give back the pages `match` mapped: the sequence waits again, holding none."""
        self.blocks.free(seq.block_table)
        seq.block_table, seq.num_registered, seq.num_computed_tokens = [], 0, 0

    def _digest_pages(self, seq, pages: int) -> None:
        have, bs = len(seq.block_digests), self.blocks.block_size
        if have < pages:
            parent = seq.block_digests[-1] if have else ROOT
            seq.block_digests += prefix_digests(seq.tokens(have * bs, pages * bs), bs, parent)

    def register(self, seq) -> None:
        """Register the sequence's full prompt pages whose KV is enqueued (as their steps launch)."""
        self._register(seq, len(seq.prompt_token_ids))

    def release(self, seq) -> None:
        """Give back every page the sequence holds (released or preempted), its full pages of known tokens whose KV
        is enqueued registered first, outputs included: a later turn that carries them, or its own recompute,
        maps them."""
        if self.blocks.caching:
            self._register(seq, seq.num_tokens)
        self.blocks.free(seq.block_table)
        seq.block_table, seq.num_registered = [], 0

    def _register(self, seq, known: int) -> None:
        bs = self.blocks.block_size
        full = min(known, seq.num_computed_tokens, len(seq.block_table) * bs) // bs
        if full <= seq.num_registered:
            return
        self._digest_pages(seq, full)
        new = self.blocks.register_pages(seq.block_table, seq.block_digests, seq.num_registered, full)
        seq.num_registered = full
        if new and self.blocks.events is not None:
            self._record_stored(seq, new)

    def _record_stored(self, seq, pages: list[int]) -> None:
        """One "stored" record a run of consecutive newly registered pages: digests, parent digest, tokens."""
        bs, digests, start = self.blocks.block_size, seq.block_digests, 0
        for j in range(1, len(pages) + 1):
            if j == len(pages) or pages[j] != pages[j - 1] + 1:
                first, last = pages[start], pages[j - 1]
                self.blocks.events.append(("stored", digests[first:last + 1], digests[first - 1] if first else None,
                                           seq.tokens(first * bs, (last + 1) * bs)))
                start = j
