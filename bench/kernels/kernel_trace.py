"""A profiled window's device kernels, summed per step: by kind, by name or launch grid, the GPU's busy fraction
and each kernel's share of the critical path (how far it moves the latest end). torch.profiler's events (CUDA
activity) or their exported Chrome trace; bench/step/profile_step.py and bench/guided/guided_speed.py read them.
"""
from __future__ import annotations

import json
import re
from types import SimpleNamespace

KINDS = (("matmul", r"gemm|gemv|matmul|cutlass|nvjet|cublas|sm90_xmma|splitk"),
         ("attention", r"attention|attn|flash|paged"),
         ("norm", r"rms|norm"),
         ("rope / kv store", r"rope|store_kv|kv_store"),
         ("copy", r"memcpy|memset|copy"),
         ("sampling", r"argmax|softmax|topk|sort|multinomial|exponential|bitmask|sample"),
         ("index / where", r"index|gather|scatter|where|clamp|fill"),
         ("elementwise", r"elementwise|vectorized|unrolled|reduce|add|mul|silu|act"))


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, pattern in KINDS if re.search(pattern, low)), "other")


def device_events(prof) -> list:
    from torch.autograd import DeviceType
    return [e for e in prof.events() if e.device_type == DeviceType.CUDA]


def busy_fraction(events) -> float:
    """Share of the window from the first kernel's start to the last one's end with any kernel running."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    if not spans:
        return 0.0
    busy, (cur_s, cur_e) = 0.0, spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            busy, cur_s = busy + cur_e - cur_s, s
        cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    return busy / max(spans[-1][1] - spans[0][0], 1e-9)


def path_times(events) -> list:
    """Each event's share of the window's critical path: how far its end moves the latest end seen so far, in
    the order events end. Under dependent launch a kernel starts before the one ahead of it ends, so its own
    duration overstates what it costs the step; this does not (a kernel ending before the latest end costs 0).
    Exact for one stream's chain; with streams side by side, a kernel is charged for what runs beside it."""
    out, last = [], None
    for e in sorted(events, key=lambda e: e.time_range.end):
        end = e.time_range.end
        out.append((e, end - max(last if last is not None else e.time_range.start, e.time_range.start)))
        last = end if last is None else max(last, end)
    return out


def _per_step(events, key, steps: int) -> dict:
    """{key(event): {per_step, us_per_step, path_us_per_step}}."""
    acc: dict[str, list] = {}
    for e, path in path_times(events):
        entry = acc.setdefault(key(e), [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += e.time_range.end - e.time_range.start
        entry[2] += max(path, 0.0)
    return {k: dict(per_step=n / steps, us_per_step=t / steps, path_us_per_step=p / steps)
            for k, (n, t, p) in acc.items()}


def kernel_summary(events, steps: int, top: int = 15) -> dict:
    kinds = dict(sorted(_per_step(events, lambda e: kind_of(e.name), steps).items()))
    names = sorted(_per_step(events, lambda e: e.name[:90], steps).items(), key=lambda kv: -kv[1]["path_us_per_step"])
    return dict(kernels=len(events) / steps, kernel_us=sum(v["us_per_step"] for v in kinds.values()),
                path_us=sum(v["path_us_per_step"] for v in kinds.values()), busy_frac=busy_fraction(events),
                kinds=kinds, top_kernels=dict(names[:top]))


def _trace_kernel(ev: dict) -> SimpleNamespace:
    """A kernel of an exported trace, shaped as a profiler event for _per_step: name (with its grid), span."""
    start = float(ev["ts"])
    return SimpleNamespace(name=f"{ev['name'][:60]} grid={tuple(ev.get('args', {}).get('grid', ()))}",
                           time_range=SimpleNamespace(start=start, end=start + float(ev.get("dur", 0.0))))


def kernels_by_grid(prof, steps: int, top: int) -> dict:
    """Kernels keyed by name and grid, from the profiler's exported trace (events do not carry the grid)."""
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as exported:
            trace = json.load(exported)
    events = [_trace_kernel(ev) for ev in trace.get("traceEvents", []) if ev.get("cat") == "kernel"]
    rows = sorted(_per_step(events, lambda e: e.name, steps).items(), key=lambda kv: -kv[1]["path_us_per_step"])
    return dict(rows[:top])
