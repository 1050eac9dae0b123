"""bench/peers/peers_vllm.py's rows and what it makes of them: the modes and columns, the cross-checks of the two
sides' outputs (same tokens, same text, lossless speculation) and the report (markdown table, plot by mode)."""
from __future__ import annotations

from pathlib import Path

from bench.common import markdown_table, note

SIDES = ("specdec", "vllm")
PARTS = ("decode", "guided", "ngram")
MODES = {"decode": ("decode",), "guided": ("guided", "free", "jme"), "ngram": ("ngram", "ngram_guided")}
ORDER = [m for part in PARTS for m in MODES[part]]
BASELINE = {"ngram": "jme", "ngram_guided": "guided"}     # the same work without the drafter
COLUMNS = ["mode", "streams", "side", "tok_s", "over_vllm", "ms_per_step", "ttft_ms", "tpot_ms", "guided_over_free",
           "accept_len", "spec_speedup", "mean_len", "finished_frac", "same_tokens", "same_text", "same_as_plain",
           "startup_s", "error"]


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def same_share(a: list[list[int]], b: list[list[int]], eos_ids) -> float:
    """Share of outputs with identical token ids, a final EOS aside (vLLM leaves it out of token_ids)."""
    strip = lambda ids: ids[:-1] if ids and ids[-1] in eos_ids else ids    # noqa: E731
    return sum(strip(x) == strip(y) for x, y in zip(a, b)) / max(len(a), 1)


def cross_check(records: list[dict], outputs: dict, plan: dict) -> None:
    """Across sides: same_tokens (decode), same_text (every other mode); within a side: same_as_plain (a
    drafter's outputs equal the same engine's without it: greedy speculation is lossless) and spec_speedup;
    over_vllm on our rows where both sides ran."""
    by = {(r["side"], r["mode"], r["streams"]): r for r in records}
    eos = set(plan.get("eos_ids", ()))
    for (side, mode, n), r in by.items():
        key = str(n)
        ours, theirs = (outputs.get(s, {}).get(mode, {}).get(key) for s in SIDES)
        if ours and theirs and mode == "decode":
            r["same_tokens"] = sum(shared_prefix(a, b) for a, b in zip(ours, theirs)) / (n * plan["new_tokens"])
        elif ours and theirs and mode != "free":
            r["same_text"] = same_share(ours, theirs, eos)
        base = BASELINE.get(mode)
        mine, plain = (outputs.get(side, {}).get(m, {}).get(key) for m in (mode, base))
        if base and mine and plain:
            r["same_as_plain"] = same_share(mine, plain, eos)
        b = by.get((side, base, n))
        if b and b.get("tok_s") and r.get("tok_s"):
            r["spec_speedup"] = r["tok_s"] / b["tok_s"]
        other = by.get(("vllm", mode, n))
        if side == "specdec" and other and other.get("tok_s") and r.get("tok_s"):
            r.update(vllm_tok_s=other["tok_s"], over_vllm=r["tok_s"] / other["tok_s"])


def write_markdown(records: list[dict], path: Path) -> str:
    r = records[0]
    versions = sorted({x.get("vllm_version") for x in records if x.get("vllm_version")})
    commands = "; ".join(f"`{c}`" for c in dict.fromkeys(x["command"] for x in records))
    commits = ", ".join(sorted({x["git_commit"] for x in records}))
    head = (f"{commands} on {r['device']}, commit {commits}; {r['model']} {r['dtype']}, greedy; "
            f"vLLM {', '.join(versions) or '(not run)'}. Method: bench/peers/peers_vllm.py's docstring.")
    skipped = max((x.get("schemas_skipped") or 0 for x in records), default=0)
    if skipped:
        head += (f" Guided work: {max(x.get('schemas') or 0 for x in records)} schemas; {skipped} of the first "
                 "ones left out on both sides, refused by ours (a keyword its grammar cannot enforce) or by vLLM's "
                 "xgrammar backend (its keyword pre-check): "
                 + "; ".join(next(x.get("skipped_schemas") or [] for x in records if x.get("skipped_schemas"))) + ".")
    rows = sorted(records, key=lambda x: (ORDER.index(x["mode"]) if x["mode"] in ORDER else 99, x["streams"],
                                          x["side"]))
    cols = [c for c in COLUMNS if any(x.get(c) is not None for x in rows)]
    text = head + "\n\n" + markdown_table(rows, cols)
    path.write_text(text + "\n")
    return text


def plot_modes(records: list[dict], path: Path, title: str) -> None:
    """One panel per mode: tok/s by streams, a line per side."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        note("matplotlib is not installed; no plot")
        return
    modes = [m for m in ORDER if any(r["mode"] == m and r.get("tok_s") for r in records)]
    if not modes:
        return
    cols = min(len(modes), 4)
    fig, axes = plt.subplots(-(-len(modes) // cols), cols, figsize=(3.6 * cols, 3.2 * -(-len(modes) // cols)),
                             squeeze=False)
    for ax, mode in zip(axes.flat, modes):
        for side in SIDES:
            pts = sorted((r["streams"], r["tok_s"]) for r in records
                         if r["mode"] == mode and r["side"] == side and r.get("tok_s"))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=side)
        ax.set(title=mode, xlabel="streams", ylabel="tok/s", xscale="log", yscale="log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(modes):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
