"""The collectives a tensor-parallel step calls, on process-group objects the engine owns (no global
`torch.distributed` state: two engines in one process do not share a group).

Each rank has two groups over one TCPStore: `device_pg` carries what the step computes (NCCL on CUDA, gloo on
the CPU; captured inside the CUDA graphs), `control_pg` (gloo, CPU tensors) carries the step messages from
rank 0 (engine/workers/channel.py) and start-up agreements. Rank 0 decides what must agree across ranks
(grammar masks, drafts) and `broadcast` hands it to the others; everything else every rank computes alike
from identical inputs (all-reduced hidden states, all-gathered logits, the seeded sampler).
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker died, hung or failed: the engine cannot go on (every rank holds part of it)."""


class TPGroup:
    """One process: every collective is the identity."""
    rank, world = 0, 1

    @property
    def decides(self) -> bool:
        """Rank 0 runs the grammar and decides; the others receive."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_vocab(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def agree_min(self, value: int) -> int:
        return value


SINGLE = TPGroup()


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class DistGroup(TPGroup):
    def __init__(self, store, rank: int, world: int, backend: str, timeout_s: float):
        self.rank, self.world, self.backend = rank, world, backend
        self.control_pg = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, world, _timeout(86400 * 365))
        if backend == "nccl":
            self.device_pg = dist.ProcessGroupNCCL(dist.PrefixStore("device", store), rank, world)
        else:
            self.device_pg = dist.ProcessGroupGloo(dist.PrefixStore("device", store), rank, world, _timeout(timeout_s))
        self._root = dist.BroadcastOptions()
        self._root.rootRank = 0
        self._min = dist.AllreduceOptions()
        self._min.reduceOp = dist.ReduceOp.MIN

    # ---- inside a step (device tensors; captured on CUDA) ------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.device_pg.allreduce([x]).wait()
        return x

    def gather_vocab(self, x: torch.Tensor) -> torch.Tensor:
        """[T, V / world] logits of each rank -> [T, V] on every rank (in rank order)."""
        t, part = x.shape
        if self.backend == "gloo" and x.is_cuda:        # gloo has no all-gather of CUDA tensors: sum disjoint parts
            out = x.new_zeros(t, self.world * part)
            out[:, self.rank * part:(self.rank + 1) * part] = x
            return self.all_reduce(out)
        out = x.new_empty(self.world * t, part)
        self.device_pg._allgather_base(out, x.contiguous()).wait()
        return out.view(self.world, t, part).permute(1, 0, 2).reshape(t, self.world * part)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x into every rank's x (contiguous, in place)."""
        self.device_pg.broadcast([x], self._root).wait()
        return x

    # ---- control (CPU tensors) ---------------------------------------------------------------
    def agree_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        self.control_pg.allreduce([t], self._min).wait()
        return int(t.item())

    def control_broadcast(self, x: torch.Tensor) -> torch.Tensor:
        self.control_pg.broadcast([x], self._root).wait()
        return x

    def abort(self) -> None:
        """Make collectives blocked on a lost rank return (NCCL kernels spinning in a graph included)."""
        for pg in (self.device_pg, self.control_pg):
            try:
                pg.abort()
            except Exception:       # noqa: BLE001 - best effort: not every backend / version can abort
                pass
