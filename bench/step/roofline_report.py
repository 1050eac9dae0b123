"""The roofline bench's table, targets and heat map, from its records (bench/step/roofline.py): apart from the run,
so a JSON from a cut or finished run renders again (--render) without an engine or a GPU.

The step/floor colours are the targets' bands: under 1.3x the floor (the small-batch target) greens, 1.3-1.6x (the
large-batch one) yellow, over that orange and red; under 1.0, blue: faster than the floor, so the floor is wrong
(the peak given, or reads served from L2). auto/ref: white within 2% of cuBLAS, blues where auto is faster, orange
and red where it is slower.
"""
from __future__ import annotations

import math
from pathlib import Path

from bench.common import _pyplot, _save, markdown_table

AUTO, REF, FLOOR = "step ms (auto)", "step ms (reference)", "step/floor"
COLUMNS = ["shape", "streams", "context", AUTO, REF, "auto/ref", "floor ms", FLOOR, "tok/s", "note"]
BILLION = 1e9
# (title, row key, bounds, colours between them, colour under, colour over)
PANELS = (
    ("step / floor", FLOOR, [1.0, 1.1, 1.3, 1.6, 2.0], ["#1a9850", "#91cf60", "#fee08b", "#fc8d59"], "#4575b4",
     "#d73027"),
    ("auto / reference", "auto/ref", [0.9, 0.98, 1.02, 1.1], ["#91bfdb", "#f7f7f7", "#fc8d59"], "#4575b4", "#d73027"),
)


def primary_side(records: list[dict]) -> str:
    """The side whose step the floor columns measure: auto where the run has it, else reference."""
    return "auto" if any(r.get("kernels") == "auto" for r in records) else "reference"


def cell_rows(records: list[dict]) -> list[dict]:
    """One row per (shape, streams, context), the sides side by side, in the records' shape order."""
    side, rows = primary_side(records), {}
    for r in records:
        row = rows.setdefault((r["shape"], r["streams"], r["context"]),
                              dict(shape=r["shape"], streams=r["streams"], context=r["context"], notes=[]))
        row["params"] = row.get("params") or r.get("params")       # a failed side's record has none
        ms = r.get("ms_per_step")
        row[AUTO if r["kernels"] == "auto" else REF] = ms
        if r["kernels"] == side:
            row.update({"floor ms": r.get("floor_ms"), FLOOR: r.get("x_floor"), "tok/s": r.get("tok_s")})
        if r.get("skipped") or r.get("error"):
            row["notes"].append(f"{r['kernels']}: {r.get('skipped') or r.get('error')}")
    shapes = list(dict.fromkeys(r["shape"] for r in records))
    out = sorted(rows.values(), key=lambda x: (shapes.index(x["shape"]), x["context"], x["streams"]))
    for row in out:
        auto, ref = row.get(AUTO), row.get(REF)
        row["auto/ref"] = auto / ref if auto and ref else None
        row["note"] = "; ".join(row.pop("notes")) or None
    return out


def verdict(name: str, rows: list[dict], key: str, limit: float) -> str:
    """One target's line: holds over the cells measured, fails (how many, the worst) or was not measured."""
    measured = [r for r in rows if r.get(key) is not None]
    if not measured:
        return f"- {name}: not measured"
    over = [r for r in measured if r[key] > limit]
    if not over:
        return f"- {name}: **holds** in all {len(measured)} cells (worst {max(r[key] for r in measured):.2f})"
    w = max(over, key=lambda r: r[key])
    return (f"- {name}: **fails** in {len(over)} of {len(measured)} cells; worst {w['shape']} at {w['streams']} "
            f"streams, {w['context']} tokens: {w[key]:.2f}")


def targets(rows: list[dict], side: str) -> list[str]:
    big = [r for r in rows if (r.get("params") or 0) >= BILLION]
    at = f" ({side} side)" if side != "auto" else ""
    return [
        verdict("no cell more than 2% slower than --kernels reference (auto/ref <= 1.02)", rows, "auto/ref", 1.02),
        verdict(f"shapes of 1B and larger, 1-8 streams, at most 1.3x the floor{at}",
                [r for r in big if r["streams"] <= 8], FLOOR, 1.3),
        verdict(f"shapes of 1B and larger, 16-128 streams, at most 1.6x the floor{at}",
                [r for r in big if r["streams"] > 8], FLOOR, 1.6),
        verdict(f"Llama-3.2-1B (llama-1b) at 32 streams, 2,048 tokens, at most 1.5x the floor{at}",
                [r for r in rows if (r["shape"], r["streams"], r["context"]) == ("llama-1b", 32, 2048)], FLOOR, 1.5),
    ]


def _grid(rows: list[dict], key: str):
    """(row labels, streams, values[label][streams]; NaN where the cell has no value)."""
    labels = list(dict.fromkeys((r["shape"], r["context"]) for r in rows))
    streams = sorted({r["streams"] for r in rows})
    values = [[math.nan] * len(streams) for _ in labels]
    for r in rows:
        if r.get(key) is not None:
            values[labels.index((r["shape"], r["context"]))][streams.index(r["streams"])] = r[key]
    return [f"{s}, {c} tok" for s, c in labels], streams, values


def _panel(fig, ax, rows, title, key, bounds, colours, under, over) -> None:
    import matplotlib.colors as mcolors
    import numpy as np
    labels, streams, values = _grid(rows, key)
    cmap = mcolors.ListedColormap(colours).with_extremes(under=under, over=over, bad="#d9d9d9")
    data = np.ma.masked_invalid(np.array(values, dtype=float))
    im = ax.imshow(data, cmap=cmap, norm=mcolors.BoundaryNorm(bounds, cmap.N), aspect="auto")
    for i, line in enumerate(values):
        for j, v in enumerate(line):
            ax.text(j, i, "-" if math.isnan(v) else f"{v:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(streams)), [str(s) for s in streams])
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("streams")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, extend="both", ticks=bounds)


def heat_map(rows: list[dict], path, side: str) -> Path | None:
    """roofline.png: step / floor of the primary side, and auto / reference where both sides ran."""
    if (plt := _pyplot(path)) is None:
        return None
    panels = [p for p in PANELS if any(r.get(p[1]) is not None for r in rows)] or PANELS[:1]
    height = 1.6 + 0.36 * len({(r["shape"], r["context"]) for r in rows})
    width = 2.4 + 0.55 * len({r["streams"] for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(width * len(panels), height), squeeze=False)
    for ax, (title, *spec) in zip(axes[0], panels):
        _panel(fig, ax, rows, f"{title} ({side})" if spec[0] == FLOOR else title, *spec)
    path = _save(fig, path)
    plt.close(fig)
    return path


def render(records: list[dict], out: Path) -> str:
    """Write roofline.md (the table, then which targets hold) and roofline.png into `out`; the markdown."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if not records:
        text = "No cells measured.\n"
    else:
        side, rows, first = primary_side(records), cell_rows(records), records[0]
        peak = next((r["peak_gbps"] for r in records if r.get("peak_gbps")), None)
        text = (f"Command: `{first['command']}` on {first['device']}, commit {first['git_commit']}; peak "
                f"{peak} GB/s, about {first.get('steps_asked')} steady decode steps a cell, {first['dtype']}. "
                f"Step: the median steady step period; floor: (weights + the KV the step reads) / peak; step/floor "
                f"and tok/s of the {side} side.\n\n" + markdown_table(rows, COLUMNS)
                + "\n\nTargets:\n\n" + "\n".join(targets(rows, side)) + "\n")
        heat_map(rows, out / "roofline.png", side)
    (out / "roofline.md").write_text(text)
    return text
