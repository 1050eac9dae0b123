"""Shared helpers for the benchmarks: result records, JSON/markdown/PNG output, progress, workloads.

Every benchmark builds records with `record(...)` (one schema for all of them), writes them with
`write_results`, prints `markdown_table` last and may `plot` a PNG beside the JSON.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import gc
import json
import os
import sys
import time
from pathlib import Path

# the prompt sets live in specdec/ (studies use them too; a package never imports bench/); re-exported here
from specdec.datasets import QUESTIONS, chat_prompts, random_prompts  # noqa: F401
from specdec.revision import git_commit  # noqa: F401

REPO = Path(__file__).resolve().parent.parent


def kernel_device(device: str, script: str) -> None:
    """A kernel bench's --device: "cpu" runs its kernels in the Triton interpreter (TRITON_INTERPRET must be set
    before Triton is imported, so call this first); "cuda" needs a GPU."""
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        return
    import torch
    if not torch.cuda.is_available():
        sys.exit(f"{script} needs a CUDA GPU (or --device cpu for the interpreter smoke test)")


# ---- records ---------------------------------------------------------------------------------------
def device_name() -> str:
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except Exception:                      # noqa: BLE001 - a record must never fail on this
        pass
    return f"cpu ({cpu_model()}, {os.cpu_count()} cores)"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def command_line() -> str:
    return " ".join([sys.executable, *sys.argv])


def record(bench, mode, model, dtype, streams, new_tokens, tok_s, ms_per_step, **extra) -> dict:
    """One result row; `extra` holds bench-specific fields (breakdowns, error strings, ...)."""
    rec = dict(bench=bench, mode=mode, model=model, dtype=dtype, streams=streams, new_tokens=new_tokens,
               tok_s=tok_s, ms_per_step=ms_per_step)
    rec.update(extra)
    rec.update(device=device_name(), git_commit=git_commit(), command=command_line(),
               timestamp=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    return rec


def write_results(records: list[dict], path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=2, default=str) + "\n")
    print(f"wrote {len(records)} records to {path}")
    return path


def copy_bandwidth_gbs(nbytes: int = 1 << 30, reps: int = 20) -> float | None:
    """The GPU's device-to-device copy bandwidth, (read + write) bytes / s, in GB/s; None without CUDA."""
    import torch
    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * nbytes * reps / (start.elapsed_time(end) * 1e-3) / 1e9


def cuda_sync() -> None:
    """Wait for the GPU where there is one (a timed span ends when its work does)."""
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_gpu_memory() -> None:
    """Collect what a dropped engine or model left, then give the CUDA allocator's cached blocks back, so that the
    next engine sizes its KV pages from the memory really free."""
    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def frozen_heap():
    """The heap collected and frozen (gc.freeze) for the block, as in the server's engine process, so that a
    collection inside it walks only what the block made; unfrozen after, since a frozen object is never collected
    (the next engine would not get a dropped one's memory back)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class GcClock:
    """The garbage collections Python runs while installed (a gc.callbacks entry): (generation, ms) each."""

    def __init__(self):
        self.pauses, self._t0 = [], None

    def __call__(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.pauses.append((info["generation"], 1e3 * (time.perf_counter() - self._t0)))

    @property
    def ms(self) -> float:
        return sum(ms for _, ms in self.pauses)

    @property
    def count(self) -> dict[int, int]:
        return {g: sum(gen == g for gen, _ in self.pauses) for g in range(3)}

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


# ---- output ----------------------------------------------------------------------------------------
def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.2f}" if abs(v) >= 1 else f"{v:.3f}"
    if isinstance(v, int):
        return f"{v:,}" if abs(v) >= 10000 else str(v)
    s = str(v).replace("|", "\\|").replace("\n", " ")
    return s if len(s) <= 60 else s[:57] + "..."


def markdown_table(records: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(" --- " for _ in columns) + "|"]
    for r in records:
        lines.append("| " + " | ".join(_cell(r.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def _pyplot(path):
    """matplotlib's pyplot on the file backend, or None (and a note) where matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib is not installed; skipping the plot {path}")
        return None
    return plt


def _save(fig, path, rect=(0, 0, 1, 1)) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=120)
    print(f"wrote plot {path}")
    return path


def plot(records: list[dict], x: str, y: str, group: str, path, title: str, logy: bool = False) -> Path | None:
    """Line plot of y vs x, one line per value of `group`; records without a numeric y are skipped."""
    if (plt := _pyplot(path)) is None:
        return None
    import matplotlib.ticker
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    groups: dict[str, list[tuple]] = {}
    for r in records:
        if isinstance(r.get(y), (int, float)) and r.get(x) is not None:
            groups.setdefault(str(r.get(group)), []).append((r[x], r[y]))
    for name, pts in sorted(groups.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if groups:
        ax.legend()
    if x == "streams":
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    if logy:
        ax.set_yscale("log")
    path = _save(fig, path)
    plt.close(fig)
    return path


def bars(rows: list[dict], panel: str, label: str, values: list[str], path, title: str) -> Path | None:
    """Grouped bars: a panel per value of `panel`, a group per row's `label`, a bar per key in `values`."""
    if (plt := _pyplot(path)) is None:
        return None
    panels = sorted({r[panel] for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 + 2.6 * len(panels), 3.8), squeeze=False)
    width = 0.8 / len(values)
    for ax, p in zip(axes[0], panels):
        group = [r for r in rows if r[panel] == p]
        for i, key in enumerate(values):
            ax.bar([j + i * width for j in range(len(group))], [r.get(key) or 0.0 for r in group], width, label=key)
        ax.set_xticks([j + width * (len(values) - 1) / 2 for j in range(len(group))], [str(r[label]) for r in group])
        ax.set_title(f"{panel} {p}")
        ax.grid(True, axis="y", alpha=0.3)
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=len(values))
    fig.suptitle(title)
    path = _save(fig, path, rect=(0, 0.07, 1, 1))
    plt.close(fig)
    return path


# ---- workloads -------------------------------------------------------------------------------------
def engine_kwargs(args, **fields) -> dict:
    """EngineConfig fields: `fields`, then the bench's --model and --device where given (unset, EngineConfig's
    defaults: SPECDEC_MODEL or the default model, and the GPU where there is one)."""
    if getattr(args, "model", None):
        fields["model"] = args.model
    if getattr(args, "device", "auto") != "auto":
        fields["device"] = args.device
    return fields


def dtype_name(eng, default: str = "") -> str:
    """The engine's dtype as result records name it ("bfloat16"); `default` for an engine that has none."""
    dtype = getattr(getattr(eng, "runner", None), "dtype", None)
    return default if dtype is None else str(dtype).replace("torch.", "")


def engine_overrides(args) -> dict:
    """--engine KEY=VALUE ... -> EngineConfig fields (values parsed as JSON when they parse, but an object stays
    text: kernel_routes' route file inline, e.g. kernel_routes='{"pins": [{"kernel": "cublas"}]}')."""
    return _overrides(getattr(args, "engine", None) or [])


def _overrides(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        out[key] = value if isinstance(parsed, dict) else parsed
    return out


def parse_variants(items: list[str]) -> dict[str, dict]:
    """--variants NAME:KEY=VALUE,... -> {NAME: EngineConfig overrides} (values parsed as JSON when they parse);
    none given: one unnamed variant without overrides."""
    out = {}
    for item in items:
        name, sep, pairs = item.partition(":")
        if not sep or not name or name in out:
            raise SystemExit(f"--variants {item!r}: expected a new NAME:KEY=VALUE,... (NAME: alone for no overrides)")
        out[name] = _overrides([p for p in pairs.split(",") if p])
        if any(not key for key in out[name]):
            raise SystemExit(f"--variants {item!r}: every override is KEY=VALUE")
    return out or {"": {}}


_FILLER = " The tide comes in and goes out again."


def stream_prompt(eng, i: int, tokens: int = 0) -> list[int]:
    """Stream i's chat prompt ("Tell me about the sea, part i."), through the chat template where the model has
    one (dummy weights have none: ids that differ from the first, so that no two streams share a cached page and
    each reads its own KV); with `tokens`, lengthened by filler sentences to at least that many prompt tokens."""
    text = f"Tell me about the sea, part {i}."
    try:
        ids = eng.apply_chat_template([{"role": "user", "content": text}])
    except ValueError:
        return [(7 * j + 31 * i) % 1000 + 1 for j in range(max(32, tokens))]
    if len(ids) < tokens:
        per = len(eng.apply_chat_template([{"role": "user", "content": text + _FILLER * 8}])) - len(ids)
        fillers = -(-8 * (tokens - len(ids)) // per)
        ids = eng.apply_chat_template([{"role": "user", "content": text + _FILLER * fillers}])
    return ids


def progress(items, desc: str):
    """Iterate with a progress bar (tqdm on stderr; a plain line per item without tqdm)."""
    items = list(items)
    try:
        from tqdm import tqdm
        return tqdm(items, desc=desc, file=sys.stderr, dynamic_ncols=True)
    except ImportError:
        def gen():
            for i, it in enumerate(items):
                print(f"{desc}: {i + 1}/{len(items)} {it}", file=sys.stderr, flush=True)
                yield it
        return gen()


def note(msg: str) -> None:
    """A status line that does not break a tqdm bar."""
    try:
        from tqdm import tqdm
        tqdm.write(msg, file=sys.stderr)
    except ImportError:
        print(msg, file=sys.stderr, flush=True)
