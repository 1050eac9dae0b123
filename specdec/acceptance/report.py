"""A study's files: PREFIX.json (the records), PREFIX.csv (one row per run), PREFIX.md (the tables and the
command) and PREFIX.png (acceptance length vs K, acceptance by draft position) when matplotlib is importable."""
from __future__ import annotations

import csv
import json
from pathlib import Path

from specdec.revision import git_commit

RUN_COLUMNS = ["dataset", "method", "k", "guided", "temperature", "prompts", "new_tokens", "steps",
               "tokens_per_step", "acceptance_length", "spec_frac", "tok_s", "speedup", "same_tokens_as_none",
               "finished_frac", "json_frac", "valid_frac", "errors"]
CSV_COLUMNS = RUN_COLUMNS + ["forced_per_step", "draft_masks", "forced_drafts", "drafter", "rows", "spec_rows",
                             "guided_steps", "wall_s", "ms_per_step", "batch", "max_tokens", "model", "dtype", "device"]


def label(r: dict) -> str:
    """A method column of the acceptance table: drafter[+masks][+forced], guided, temperature."""
    return r["method"] + " guided" * r["guided"] + (f" T={r['temperature']:g}" if r["temperature"] else "")


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.2f}" if abs(v) >= 1 else f"{v:.3f}"
    return str(v)


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows])


def acceptance_table(records: list[dict]) -> str:
    """Rows (dataset, K), columns methods: acceptance length, the target's own token included."""
    spec = [r for r in records if r["drafter"] != "none"]
    columns = list(dict.fromkeys(label(r) for r in spec))
    cells = {(r["dataset"], r["k"], label(r)): r["acceptance_length"] for r in spec}
    order = list(dict.fromkeys(r["dataset"] for r in spec))
    keys = sorted({(r["dataset"], r["k"]) for r in spec}, key=lambda key: (order.index(key[0]), key[1]))
    return table(["dataset", "K", *columns], [[d, k, *(cells.get((d, k, c)) for c in columns)] for d, k in keys])


def position_table(records: list[dict]) -> str:
    """Per run: the share of drafts proposed at position i that were accepted."""
    spec = [r for r in records if r["drafter"] != "none"]
    order = list(dict.fromkeys(r["dataset"] for r in spec))
    spec.sort(key=lambda r: (order.index(r["dataset"]), label(r), r["k"]))
    width = max((r["k"] for r in spec), default=0)
    rows = [[r["dataset"], label(r), r["k"], *(r["rate_by_position"] + [None] * width)[:width]] for r in spec]
    return table(["dataset", "method", "K", *(f"pos {i + 1}" for i in range(width))], rows)


def runs_table(records: list[dict]) -> str:
    shown = {"method": label, "temperature": lambda r: f"{r['temperature']:g}"}
    rows = [[shown[c](r) if c in shown else r.get(c) for c in RUN_COLUMNS] for r in records]
    return table(RUN_COLUMNS, rows)


def markdown(records: list[dict], command: str, commit: str, plot_note: str) -> str:
    device = records[0]["device"] if records else "?"
    cpu = device == "cpu"
    speed = ("**CPU run: tok_s is not a speed measurement** (the torch reference path, no CUDA graphs); no "
             "speedup is reported. Run on a GPU for tok/s and speedup over `none`." if cpu else
             "tok_s: output tokens / wall of the run; speedup: tok_s over `none` on the same prompts.")
    model = f"{records[0]['model']} ({records[0]['dtype']})" if records else "?"
    return "\n".join([
        f"Command: `{command}`", "", f"Commit {commit}, device {device}, model {model}.", "",
        "### Acceptance length (tokens per verifying row-step, the target's own token included: K + 1 at most)", "",
        acceptance_table(records), "",
        "### Acceptance rate by draft position (accepted / proposed at that position)", "",
        position_table(records), "",
        "### Runs", "", speed, "", runs_table(records), "", plot_note]).rstrip() + "\n"


def write_csv(records: list[dict], path: Path) -> None:
    width = max((len(r.get("rate_by_position") or []) for r in records), default=0)
    columns = CSV_COLUMNS + [f"rate_pos{i + 1}" for i in range(width)]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, columns, extrasaction="ignore")
        w.writeheader()
        for r in records:
            rates = {f"rate_pos{i + 1}": v for i, v in enumerate(r.get("rate_by_position") or [])}
            w.writerow(r | rates)


def plot(records: list[dict], path: Path) -> str:
    """The PNG, or why there is none (a line for the markdown)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"No plot: matplotlib is not installed (`pip install matplotlib` for {path.name})."
    spec = [r for r in records if r["drafter"] != "none" and r["acceptance_length"] is not None]
    curves: dict[str, list[dict]] = {}
    for r in spec:
        curves.setdefault(f"{r['dataset']} {label(r)}", []).append(r)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, rs in curves.items():
        rs.sort(key=lambda r: r["k"])
        left.plot([r["k"] for r in rs], [r["acceptance_length"] for r in rs], marker="o", label=name)
        rates = rs[-1]["rate_by_position"]
        right.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{name} K={rs[-1]['k']}")
    left.set(xlabel="K (drafts per step)", ylabel="acceptance length", title="acceptance length vs K")
    right.set(xlabel="draft position", ylabel="accepted / proposed", title="acceptance by position (largest K)",
              ylim=(0, 1.05))
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        if curves:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"Plot: {path.name}."


def write(records: list[dict], prefix: str, command: str) -> dict[str, Path]:
    """All the files of a study; returns them by suffix, the markdown's text printed by the caller."""
    base = Path(prefix)
    base.parent.mkdir(parents=True, exist_ok=True)
    paths = {s: base.with_name(base.name + s) for s in (".json", ".csv", ".md", ".png")}
    commit = git_commit()
    for r in records:
        r.update(git_commit=commit, command=command)
    paths[".json"].write_text(json.dumps(records, indent=2) + "\n")
    write_csv(records, paths[".csv"])
    note = plot(records, paths[".png"])
    if note.startswith("No plot"):
        paths.pop(".png")
    paths[".md"].write_text(markdown(records, command, commit, note))
    return paths
