"""The KV page allocator, with automatic prefix caching.

Pages are reference counted. A full page whose tokens are known and whose KV has been enqueued is registered
under a digest chained over every token up to its end (`prefix_digests`), so a later request with the same
prefix maps the same page instead of computing it. A page that no sequence holds goes back to the free list,
unless it is registered: then it stays cached, evictable, and is taken back least recently freed first when
the free list runs dry.

Why sharing a page is safe without waiting for the GPU: every KV writer runs on the one compute stream, so a
reader's step is ordered after the step that wrote the page; a registered page is never written again (its
positions hold committed tokens, below any rollback of rejected drafts).
"""
from __future__ import annotations

import struct
from collections import OrderedDict, deque
from functools import lru_cache
from hashlib import blake2b

ROOT = b""


@lru_cache(maxsize=None)
def _page_bytes(block_size: int):
    """A page's tokens as their int64 bytes (native order): struct's pack, faster than an array a page."""
    return struct.Struct(f"{block_size}q").pack


def prefix_digests(tokens: list[int], block_size: int, parent: bytes) -> list[bytes]:
    """Digests of the full pages of `tokens`, which follow the page whose digest is `parent` (ROOT: they start
    the sequence). Each digest covers every token up to its page's end, so equal digests mean equal prefixes
    (blake2b: no crafted collisions between tenants' prompts)."""
    out, pack = [], _page_bytes(block_size)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = blake2b(parent + pack(*tokens[start:start + block_size]), digest_size=16).digest()
        out.append(parent)
    return out


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, caching: bool = False):
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self._free = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._digest: dict[int, bytes] = {}                # registered page -> its digest
        self._page: dict[bytes, int] = {}                  # digest -> registered page
        self._evictable: OrderedDict[int, None] = OrderedDict()   # registered pages nobody holds, oldest first
        self.hit_tokens = self.query_tokens = self.evictions = 0
        self.events: list | None = None     # a list: the cached set's changes are recorded (memory/kv_events.py)

    @property
    def num_free(self) -> int:
        """Pages an allocation can take: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._page)

    def blocks_needed(self, num_tokens: int, have: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"out of KV blocks: want {n}, have {self.num_free}")
        blocks = [self._take() for _ in range(n)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def take_page(self) -> int | None:
        """allocate(1)'s page, or None where none is free (a decode row's next page, from native code)."""
        if not self._free and not self._evictable:
            return None
        b = self._take()
        self._refs[b] = 1
        return b

    def _take(self) -> int:
        if self._free:
            return self._free.popleft()
        b, _ = self._evictable.popitem(last=False)
        digest = self._digest.pop(b)
        del self._page[digest]
        self.evictions += 1
        if self.events is not None:
            self.events.append(("removed", [digest]))
        return b

    def free(self, blocks: list[int]) -> None:
        """Let go of `blocks` (a block table, in order). Its last pages become evictable first: a cached prefix
        is only usable from its first page, so evicting a head page would strand the pages after it."""
        for b in reversed(blocks):
            if self._refs[b] <= 0:
                raise RuntimeError(f"double free of KV block {b}")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._digest:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    # ---- prefix caching ----------------------------------------------------------------------------------
    def match(self, digests: list[bytes]) -> list[int]:
        """The registered pages of the longest prefix of `digests`, each now held once more."""
        pages = []
        for d in digests:
            b = self._page.get(d)
            if b is None:
                break
            pages.append(b)
        for b in pages:
            if self._refs[b] == 0:
                del self._evictable[b]
            self._refs[b] += 1
        return pages

    def register_pages(self, blocks: list[int], digests: list[bytes], start: int, end: int) -> list[int]:
        """blocks[i] holds the page digests[i] names, for i in [start, end); the i registered now. A page with the
        same digest already registered stays the one (this copy goes back to the free list when its holder lets
        go)."""
        page, digest_of, new = self._page, self._digest, []
        for i in range(start, end):
            block, digest = blocks[i], digests[i]
            if digest not in page and block not in digest_of:
                page[digest] = block
                digest_of[block] = digest
                new.append(i)
        return new

    def count_query(self, tokens: int, hit: int) -> None:
        self.query_tokens += tokens
        self.hit_tokens += hit

    def reset_cache(self) -> int:
        """Forget every registered page (held pages stay with their holders); returns how many were dropped."""
        dropped = len(self._page)
        if self.events is not None:
            self.events.append(("cleared",))
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._page.clear()
        self._digest.clear()
        return dropped

    def slot(self, block_table: list[int], position: int) -> int:
        return block_table[position // self.block_size] * self.block_size + position % self.block_size
