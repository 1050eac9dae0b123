"""path.png: each kernel's share of the step's critical path (profile_step.py --by-grid), SiLU * up as the down
projection's prologue (off) against the gate_up GEMV's epilogue (on), for dummy Llama 1B and 8B at one stream.

    python bench/results/silu_epilogue/plot.py
"""
import json
from pathlib import Path

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
NAMES = {"llama-1b": {"(768, 1, 1)": "qkv", "(512, 1, 1)": "o", "(4096, 1, 1)": "gate_up", "(2048, 1, 1)": "down",
                      "(32064, 1, 1)": "LM head"},
         "llama-8b": {"(3072, 1, 1)": "qkv", "(2048, 1, 1)": "o", "(14336, 1, 1)": "gate_up",
                      "(64128, 1, 1)": "LM head"}}


def label(model: str, kernel: str) -> str:
    name, _, grid = kernel.partition(" grid=")
    if name == "_decode_gemv_kernel":
        return f"GEMV {NAMES[model].get(grid, grid)}"
    if name.startswith("nvjet"):
        return "cuBLAS down"
    return name.strip("_").split("<")[0].replace("void ", "")[:28]


def path_us(tag: str, model: str) -> dict:
    rec = json.loads((HERE / f"prof_{tag}.json").read_text())[0]
    out = {}
    for kernel, v in rec["by_grid"].items():
        key = label(model, kernel)
        out[key] = out.get(key, 0.0) + v["path_us_per_step"]
    return {k: v for k, v in out.items() if v >= 2.0}


def main():
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, (model, tag) in zip(axes, [("llama-1b", "l1b"), ("llama-8b", "l8b")]):
        off, on = path_us(f"{tag}_off", model), path_us(f"{tag}_on", model)
        keys = sorted(set(off) | set(on), key=lambda k: max(off.get(k, 0), on.get(k, 0)))
        y = range(len(keys))
        ax.barh([i + 0.2 for i in y], [off.get(k, 0) for k in keys], 0.4, label="SiLU in down's prologue (off)")
        ax.barh([i - 0.2 for i in y], [on.get(k, 0) for k in keys], 0.4, label="SiLU in gate_up's epilogue (on)")
        ax.set_yticks(list(y), keys, fontsize=8)
        ax.set_xlabel("us of the step's critical path")
        ax.set_title(f"dummy {model}, 1 stream, H200")
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(HERE / "path.png", dpi=110)


if __name__ == "__main__":
    main()
