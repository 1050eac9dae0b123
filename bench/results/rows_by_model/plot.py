"""steps.png from this folder's JSON files: python bench/results/rows_by_model/plot.py"""
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent


def load(name: str) -> list[dict]:
    return json.loads((HERE / name).read_text())


def llama1b(ax):
    names = {"old": "GEMV, GEMV head", "g2": "decode_gemm from 3 rows", "new": "split by weight size"}
    steps, width = load("p_llama34.json"), 0.2
    for i, variant in enumerate(names):
        rs = sorted((r for r in steps if r["variant"] == variant), key=lambda r: r["streams"])
        ax.bar([r["streams"] + (i - 1.5) * width for r in rs], [r["period_ms"] for r in rs], width,
               label=names[variant])
    k = next(r for r in load("p_llama1b_longk.json") if r["variant"] == "new")
    ax.bar([k["streams"] + 1.5 * width], [k["period_ms"]], width, label="+ long K on cuBLAS (another run)")
    ax.set(title="Llama 1B (dummy weights): step period", xlabel="streams", ylabel="ms", xticks=[3, 4], ylim=(0, 2.3))
    ax.legend(fontsize=8, loc="upper left", ncol=2)


def llama8b(ax):
    loop, gemv2, cublas = "GEMV loops long-K rows", "decode_gemv_rows=2 (cuBLAS at 4)", "long K past 1 row on cuBLAS"
    split, longk = load("ab_llama8b_split.json"), load("ab_llama8b_longk.json")
    longk += [r for r in load("ab_llama8b_3_8.json") if r["streams"] == 3]   # at 8 both sides take cuBLAS
    bars = {loop: {r["streams"]: r["after_forward_ms"] for r in split},
            gemv2: {r["streams"]: r["before_forward_ms"] for r in split if r["streams"] == 4},
            cublas: {r["streams"]: r["after_forward_ms"] for r in longk}}
    bars[loop] |= {r["streams"]: r["before_forward_ms"] for r in longk}
    for i, (label, points) in enumerate(bars.items()):
        xs = sorted(points)
        ax.bar([s + (i - 1) * 0.25 for s in xs], [points[s] for s in xs], 0.25, label=label)
    ax.set(title="Llama 8B (dummy weights): forward GPU ms a step", xlabel="streams", ylabel="ms", xticks=[1, 2, 3, 4])
    ax.legend(fontsize=8)


if __name__ == "__main__":
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    llama1b(left)
    llama8b(right)
    fig.suptitle("H200, bf16: which kernel takes the matmuls of 2-4-row steps")
    fig.tight_layout()
    fig.savefig(HERE / "steps.png", dpi=110)
