"""Redraws speedup.png from this directory's spec_*.json (python bench/results/draft_vocab/plot.py)."""
import json, matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
D = __file__.rsplit("/", 1)[0] + "/"
groups = []
RUNS = [("spec_s1_k3", "1 stream, K=3"), ("spec_k4_rankAB", "1 stream, K=4"), ("spec_s32_k3", "32 streams, K=3")]
whole, sub = "whole_g", "v16kb_g"          # the variants: whole vocabulary, 16 K ids of the shipped ranking
for f, label in RUNS:
    recs = json.load(open(D + f + ".json"))
    for ds in ("chat", "jme"):
        get = lambda v: next(r["speedup"] for r in recs if r["dataset"] == ds and r.get("variant") == v)
        groups.append((f"{label}\n{ds}", get(whole), get(sub)))
fig, ax = plt.subplots(figsize=(9, 4))
x = range(len(groups))
ax.bar([i - 0.2 for i in x], [g[1] for g in groups], 0.4, label="whole vocabulary (49,152)")
ax.bar([i + 0.2 for i in x], [g[2] for g in groups], 0.4, label="draft vocabulary (16,384 ids)")
for i, g in enumerate(groups):
    ax.text(i - 0.2, g[1] + 0.02, f"{g[1]:.2f}", ha="center", fontsize=8)
    ax.text(i + 0.2, g[2] + 0.02, f"{g[2]:.2f}", ha="center", fontsize=8)
ax.axhline(1.6, color="gray", ls="--", lw=0.8)
ax.set_xticks(list(x), [g[0] for g in groups], fontsize=8)
ax.set_ylabel("tok/s over no speculation (same run)")
ax.set_title("EAGLE head, H100, bf16: speedup with and without the draft vocabulary")
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(D + "speedup.png", dpi=110)
