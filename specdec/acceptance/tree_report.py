"""The tree study's files: PREFIX.json (rows, tree shapes, rank coverage), PREFIX.md (tables, command) and
PREFIX.png (acceptance against draft nodes: chains and trees per dataset) when matplotlib is importable."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from specdec.acceptance import trees
from specdec.acceptance.report import table


def coverage(ranks: dict[str, list[torch.Tensor]], tops=(1, 2, 4, 8)) -> list[dict]:
    """Per dataset and depth (teacher-forced, every position with a label): the share of the target's tokens
    among the head's top-n."""
    out = []
    for name, resp in ranks.items():
        allr = torch.cat(resp)
        for d in range(allr.shape[1]):
            col = allr[:, d][allr[:, d] >= 0]
            out.append(dict(dataset=name, depth=d, **{f"top{n}": round((col < n).float().mean().item(), 3)
                                                      for n in tops}))
    return out


def write_report(rows: list[dict], shapes: dict, ranks: dict, meta: dict, out: str) -> None:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    cov = coverage(ranks)
    path.write_text(json.dumps(dict(meta=meta, rows=rows, coverage=cov,
                                    trees={str(n): [list(p) for p in s] for n, s in shapes.items()}), indent=1) + "\n")
    path.with_suffix(".md").write_text(markdown(rows, shapes, cov, meta) + "\n")
    plot(rows, path.with_suffix(".png"))
    print(f"wrote {path} (+ .md, .png)")


def markdown(rows: list[dict], shapes: dict, cov: list[dict], meta: dict) -> str:
    names = list(dict.fromkeys(r["dataset"] for r in rows))
    cell = {(r["dataset"], r["method"], r["nodes"]): r["acceptance"] for r in rows}
    chains = sorted({r["nodes"] for r in rows if r["method"] == "chain"})
    sizes = sorted({r["nodes"] for r in rows if r["method"] == "tree"})
    body = [[f"chain K={k}", k, *[cell.get((n, "chain", k)) for n in names]] for k in chains]
    body += [[f"tree of {n}", n, *[cell.get((d, "tree", n)) for d in names]] for n in sizes]
    text = [f"Command: `{meta['command']}` on {meta['device']}, commit {meta['git_commit']}; head: {meta['head']}.",
            f"Responses (greedy, no speculation): {meta.get('responses')}; tokens: {meta.get('tokens')}.", "",
            "### Acceptance length (tokens per verifying step, golden token included)", "",
            "Trees are fitted on one half of every set's responses, pooled, and measured on the other half "
            "(then the halves swap); chains need no fitting.", "",
            table(["drafts", "nodes", *names], body), "",
            "### Share of the target's tokens in the head's top n (teacher forced)", "",
            table(["dataset", "depth", "top1", "top2", "top4", "top8"],
                  [[c["dataset"], c["depth"], c["top1"], c["top2"], c["top4"], c["top8"]] for c in cov]), "",
            "### Trees fitted on all responses (rank paths: 0 = the head's first choice)", ""]
    for n, paths in shapes.items():
        text.append(f"- {n} nodes, depth {trees.tree_depth(frozenset(paths))}: "
                    + " ".join("".join(map(str, p)) for p in paths))
    return "\n".join(text)


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib is not installed; skipping the plot {path}")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, name in enumerate(dict.fromkeys(r["dataset"] for r in rows)):
        color = f"C{i}"
        for method, style in (("tree", "-o"), ("chain", "--s")):
            pts = sorted((r["nodes"], r["acceptance"]) for r in rows if r["dataset"] == name and r["method"] == method)
            if pts:
                ax.plot(*zip(*pts), style, color=color, label=f"{name} {method}", markersize=4)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("draft nodes verified per step (chain: K)")
    ax.set_ylabel("acceptance length (tokens / step)")
    ax.set_title("Tree drafts vs chains, greedy (offline)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
