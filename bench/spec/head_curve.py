"""The draft head's data-size curve and training-time-test depth: several heads trained side by side on the
same responses, each on the first N of them, then scored on the same held-out responses.

    python -m bench.spec.head_curve --data-dir runs/head/data --runs 6000:3 25000:3 0:3 0:5 --steps 3000 \
        --time-limit 480 --work runs/curve --out bench/results/head_curve.json

A run is SEQUENCES:DEPTH[:BUCKET] (0 sequences: all; BUCKET: train_head's --bucket, 1 by default). Each is
`python -m specdec.train_head --stage train` then
`--stage export` in its own directory under --work, all at once on the one GPU (--parallel), with the same
steps, batch, learning rate and time limit; a run stopped by the time limit resumes when the command is given
again. Reported per run: training sequences and tokens, steps reached, seconds, and the offline acceptance
length at K = 1 / 3 / 5 on the held-out responses, all of them and the chat ones (specdec/eagle/train.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common import command_line, device_name, git_commit, markdown_table, plot, write_results

COLUMNS = ["sequences", "depth", "bucket", "steps", "train_s", "tokens", "all_k1", "all_k3", "all_k5", "chat_k1",
           "chat_k3", "chat_k5"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--runs", nargs="+", default=["6000:3", "25000:3", "0:3", "0:5"], help="SEQUENCES:DEPTH[:BUCKET]")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--time-limit", type=float, default=480, help="seconds of training per run in this call")
    p.add_argument("--parallel", type=int, default=4, help="runs trained at once")
    p.add_argument("--work", default="runs/curve")
    p.add_argument("--out", default="bench/results/head_curve.json")
    args = p.parse_args(argv)
    args.runs = [parse_run(r) for r in args.runs]
    return args


def parse_run(text: str) -> tuple[int, int, int]:
    try:
        n, d, *b = (int(x) for x in text.split(":"))
    except ValueError:
        raise SystemExit(f"--runs takes SEQUENCES:DEPTH[:BUCKET] (e.g. 25000:3), got {text!r}") from None
    if n < 0 or not 1 <= d <= 8 or len(b) > 1 or (b and b[0] < 1):
        raise SystemExit(f"--runs {text!r}: sequences must be >= 0, depth 1..8 and bucket >= 1")
    return n, d, b[0] if b else 1


def run_dir(args, n: int, d: int, b: int = 1) -> Path:
    return Path(args.work) / (f"n{n or 'all'}_d{d}" + (f"_b{b}" if b > 1 else ""))


def command(args, n: int, d: int, b: int, stage: str) -> list[str]:
    return [sys.executable, "-m", "specdec.train_head", "--out", str(run_dir(args, n, d, b)), "--data-dir",
            args.data_dir, "--stage", stage, "--max-sequences", str(n), "--depth", str(d), "--bucket", str(b),
            "--steps", str(args.steps), "--batch", str(args.batch), "--lr", str(args.lr), "--max-len",
            str(args.max_len), "--time-limit", str(args.time_limit)]


def train_all(args) -> None:
    """Train every run (args.parallel at a time), then export the finished ones; logs under each run's dir."""
    pending = list(args.runs)
    live: list[tuple[subprocess.Popen, tuple[int, int, int]]] = []
    while pending or live:
        while pending and len(live) < args.parallel:
            run = pending.pop(0)
            run_dir(args, *run).mkdir(parents=True, exist_ok=True)
            log = open(run_dir(args, *run) / "train.log", "a")
            live.append((subprocess.Popen(command(args, *run, "train"), stdout=log, stderr=log), run))
        time.sleep(5)
        for proc, run in [x for x in live if x[0].poll() is not None]:
            live.remove((proc, run))
            print(f"[{time.strftime('%H:%M:%S')}] trained {run}: exit {proc.returncode}", file=sys.stderr, flush=True)
    for run in args.runs:
        # a run stopped by the time limit is exported too: the curve compares heads at equal time
        if (run_dir(args, *run) / "ckpt.pt").exists():
            with open(run_dir(args, *run) / "export.log", "a") as log:
                subprocess.run(command(args, *run, "export"), stdout=log, stderr=log, check=False)


def rows(args) -> list[dict]:
    out = []
    for n, d, b in args.runs:
        path = run_dir(args, n, d, b) / "acceptance.json"
        if not path.exists():
            out.append(dict(sequences=n or "all", depth=d, bucket=b, error="not exported"))
            continue
        acc = json.loads(path.read_text())
        s = acc["summary"]
        out.append(dict(sequences=s.get("sequences"), depth=d, bucket=b, steps=s.get("step"), train_s=s.get("train_s"),
                        tokens=s.get("tokens"), kinds=s.get("kinds"),
                        **{f"{name}_k{k}": acc[name][str(k)] for name in ("all", "chat") if name in acc
                           for k in (1, 3, 5)},
                        device=device_name(), git_commit=git_commit(), command=command_line()))
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    train_all(args)
    results = rows(args)
    out = write_results(results, args.out)
    base = str(out).rsplit(".", 1)[0]
    curve = [dict(sequences=r["sequences"], acceptance_k3=r[f"{name}_k3"], held_out=name)
             for r in results if r.get("depth") == 3 and r.get("bucket") == 1 and "all_k3" in r
             for name in ("all", "chat")]
    plot(curve, "sequences", "acceptance_k3", "held_out", base + ".png",
         "Draft head: offline acceptance length at K = 3 vs training data (depth 3)")
    text = (f"Command: `{command_line()}` on {device_name()}, commit {git_commit()}. Heads trained side by side "
            f"({args.parallel} at a time on the one GPU), each {args.steps} steps or {args.time_limit:.0f} s per call, "
            f"batch {args.batch}, lr {args.lr}.\n\n" + markdown_table(results, COLUMNS))
    Path(base + ".md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
