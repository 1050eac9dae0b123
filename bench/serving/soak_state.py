"""The soak's view of the server while it runs: resident memory of its process tree, the GPU memory in use and
the engine's counters from /metrics, sampled every --sample-s (bench/serving/soak.py)."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path


def rss_mb(pid: int) -> float:
    """Resident memory of the server: its process and every process under it (engine, API processes, the grammar
    compile process and its children), each counted by its proportional share (Pss) of the pages it shares: a
    compile child forked from the compile process shares most of its pages, which RSS would count twice."""
    return sum(_own_mb(p) for p in (pid, *_descendants(pid)))


def _own_mb(pid: int) -> float:
    for path, key in ((f"/proc/{pid}/smaps_rollup", "Pss:"), (f"/proc/{pid}/status", "VmRSS:")):
        try:
            for line in Path(path).read_text().splitlines():
                if line.startswith(key):
                    return int(line.split()[1]) / 1024
        except OSError:
            continue
    return 0.0


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    out, todo = [], list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, ())
    return out


def gpu_used_mb() -> float:
    try:
        import torch
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            return (total - free) / 2 ** 20
    except Exception:                       # noqa: BLE001 - a sample must never end the soak
        pass
    return 0.0


async def metric(client, base: str, name: str) -> float:
    text = (await client.get(f"{base}/metrics")).text
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")), -1.0)


async def sampler(client, base: str, pid: int, every: float, deadline: float, out: list) -> None:
    t_start = time.perf_counter()
    while True:
        out.append(dict(t=time.perf_counter() - t_start, rss_mb=rss_mb(pid), gpu_mb=gpu_used_mb(),
                        kv_blocks=await metric(client, base, "specdec_kv_blocks_used")))
        if time.perf_counter() >= deadline:
            return
        await asyncio.sleep(min(every, max(0.0, deadline - time.perf_counter())))
