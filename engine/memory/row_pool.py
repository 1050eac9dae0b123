"""A host-side free list of per-sequence device state rows (the token pool's, the penalties' counts).

A sequence takes a row, kept on it as `seq.<field>`, when it first gets pages and gives it back when it gives
its pages back (preemption, release), so a row is never held by a sequence that holds no pages."""
from __future__ import annotations

from typing import Callable


class RowPool:
    def __init__(self, num_rows: int, field: str = "pool_row", wants: Callable | None = None):
        self.num_rows = num_rows
        self._free = list(range(num_rows - 1, -1, -1))
        self.field = field
        self.wants = wants                   # which sequences need a row (None: every one)

    def __len__(self) -> int:
        return len(self._free)

    def take(self, seq) -> bool:
        """False when a row is needed and none is free (the sequence waits)."""
        if getattr(seq, self.field) >= 0 or (self.wants is not None and not self.wants(seq)):
            return True
        if not self._free:
            return False
        setattr(seq, self.field, self._free.pop())
        return True

    def give_back(self, seq) -> None:
        row = getattr(seq, self.field)
        if row >= 0:
            self._free.append(row)
            setattr(seq, self.field, -1)
