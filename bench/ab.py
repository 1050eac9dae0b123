"""A/B: the throughput bench on two source trees in one run, side by side (the machines are noisy, so a
before/after ratio is only worth something when both sides ran together).

    python bench/ab.py --before .old --after . --streams 1 8 32 --rounds 2 --out bench/results/refactor_ab.json

Each (round, tree) runs `bench/throughput.py --depth 2` of that tree in a subprocess whose PYTHONPATH is
the tree, so each side imports its own engine; rounds alternate the order (A B, B A, ...). The table gives
the median tok/s per side and after/before.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    from bench.common import markdown_table, note, record, write_results
except ImportError:
    from common import markdown_table, note, record, write_results


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, help="source tree of the baseline (e.g. a git worktree)")
    p.add_argument("--after", default=".", help="source tree of the change")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="bench/results/ab.json")
    return p.parse_args(argv)


def run_tree(tree: Path, streams, new_tokens: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "t.json"
        env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        cmd = [sys.executable, str(tree / "bench" / "throughput.py"), "--depth", "2", "--new-tokens",
               str(new_tokens), "--out", str(out), "--streams", *map(str, streams)]
        subprocess.run(cmd, cwd=tree, env=env, check=True)
        return json.loads(out.read_text())


def main(argv=None):
    args = parse_args(argv)
    trees = {"before": Path(args.before).resolve(), "after": Path(args.after).resolve()}
    runs = {name: [] for name in trees}
    for r in range(args.rounds):
        for name in (list(trees) if r % 2 == 0 else list(reversed(trees))):
            note(f"round {r + 1}/{args.rounds}: {name} ({trees[name]})")
            runs[name] += run_tree(trees[name], args.streams, args.new_tokens)
    records = []
    for s in args.streams:
        tok = {n: [x["tok_s"] for x in runs[n] if x["streams"] == s and x.get("tok_s")] for n in trees}
        med = {n: statistics.median(v) if v else None for n, v in tok.items()}
        ratio = med["after"] / med["before"] if med["after"] and med["before"] else None
        first = next(x for x in runs["after"] if x["streams"] == s)
        records.append(record("ab_throughput", "pipelined", first["model"], first["dtype"], s, args.new_tokens,
                              med["after"], first.get("ms_per_step"), before_tok_s=med["before"],
                              after_over_before=ratio, before_runs=tok["before"], after_runs=tok["after"],
                              before_tree=str(trees["before"]), rounds=args.rounds))
    write_results(records, args.out)
    print(write_markdown(records, str(args.out).rsplit(".", 1)[0] + ".md"))
    return records


COLUMNS = ["streams", "before_tok_s", "tok_s", "after_over_before", "before_runs", "after_runs"]


def write_markdown(records: list[dict], path) -> str:
    r = records[0]
    text = (f"Command: `{r['command']}` on {r['device']}, after = commit {r['git_commit']}, before = "
            f"{r['before_tree']}; {r['model']} {r['dtype']}, {r['new_tokens']} new tokens, pipelined, EOS "
            f"ignored; median of {r['rounds']} rounds (tok_s = after).\n\n" + markdown_table(records, COLUMNS))
    Path(path).write_text(text + "\n")
    return text


if __name__ == "__main__":
    main()
