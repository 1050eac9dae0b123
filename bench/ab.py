"""A/B: the plain, guided and speculative floors of two source trees in one run, side by side (the machines
are noisy, so a before/after ratio is only worth something when both sides ran together).

    python -m bench.ab --before .old --after . --modes plain guided spec --streams 1 8 32 --rounds 2 \
        --out bench/results/refactor_ab.json
    python -m bench.ab --before-engine native_launch=false --modes plain --streams 1 32   # a setting, one tree
    python -m bench.ab --model dummy:llama-1b --before-engine kernels=reference --modes plain --streams 4   # both sides

Each (round, mode, tree) runs that tree's own bench in a subprocess whose PYTHONPATH is the tree, so each side
imports its own engine, with that side's --before-engine / --after-engine settings (EngineConfig fields); rounds
alternate the order (A B, B A, ...). Modes: plain = `python -m bench.step.throughput --depth 2` (EOS ignored);
guided = `python -m bench.guided.guided --only speed` (JSON Mode Eval schemas, guided rows' tok/s); guided-open =
the same with close_at_budget and repetition_guard off (a tree from before them: its guided mode); spec =
`python -m bench.spec.spec --only speed --drafters ngram` (K = 3, JSON Mode Eval prompts). A tree with the older flat
bench/ layout runs the same scripts as files (bench/<script>.py) instead. Schemas and prompts come
from `--data` (default: the few kept in tests/data). The table gives the median tok/s per side and after/before, and
each side's idle share: the compute stream's idle time over the step period. Over HOST_BOUND a side was host-bound
(its host could not keep the GPU fed), so its ratio there measures that run's host, not the change. Each side's
median forward (GPU ms a step, where its bench reports it) is the GPU's own measure: a host's lag cannot move it, the
kernels and the load can (greedy bf16 outputs, and so the load, may differ where kernels sum in another order).
Where the sides' benches finished different numbers of requests (guided's requests_done), `requests_done` gives
both medians: the two sides then ran different loads. `before_gc_ms` / `after_gc_ms` are the milliseconds of Python's
garbage collections inside each side's timed run (plain mode), which its tok/s includes: a tree whose throughput
bench does not freeze the heap before timing can pay a collection the other side does not.
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

from bench.common import markdown_table, note, record, write_results


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", default=".", help="source tree of the baseline (e.g. a git worktree)")
    p.add_argument("--after", default=".", help="source tree of the change")
    p.add_argument("--before-engine", nargs="*", default=[], metavar="KEY=VALUE", help="the before side's settings")
    p.add_argument("--after-engine", nargs="*", default=[], metavar="KEY=VALUE", help="the after side's settings")
    p.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["plain"])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default=None, help="model spec for both sides (e.g. dummy:llama-1b; default: each "
                   "bench's default model)")
    p.add_argument("--data", default="tests/data", help="root of maskbench/JME_*.json (guided and spec modes)")
    p.add_argument("--out", default="bench/results/ab.json")
    args = p.parse_args(argv)
    if Path(args.before).resolve() == Path(args.after).resolve() and args.before_engine == args.after_engine:
        raise ValueError("before and after are the same tree with the same settings: give another --before or "
                         "--before-engine / --after-engine")
    if args.model and args.model.startswith("dummy"):
        from engine.models.loader import resolve_model
        resolve_model(args.model)       # a misspelt shape fails here, not in every run of both sides
    return args


OPEN_FLAG = "--open-too"      # guided bench: also run guided rows with the closing off

# mode -> (the tree's bench and its arguments, which of its rows are the mode's tok/s)
MODES = {
    "plain": (lambda a: ["step/throughput.py", "--depth", "2", "--new-tokens", str(a.new_tokens)], lambda r: True),
    "guided": (lambda a: ["guided/guided.py", "--only", "speed", "--rounds", "1", "--steps", "400", "--max-tokens",
                          str(a.new_tokens), "--data", str(Path(a.data).resolve())], lambda r: r["mode"] == "guided"),
    # guided with the closing off (close_at_budget, repetition_guard): guided-open rows; a tree without the closing
    # (its guided bench has no --open-too) runs its guided mode, which is the same thing there
    "guided-open": (lambda a: [*MODES["guided"][0](a), OPEN_FLAG], lambda r: r["mode"] in ("guided", "guided-open")),
    "spec": (lambda a: ["spec/spec.py", "--only", "speed", "--drafters", "ngram", "--datasets", "JME", "--rounds", "1",
                        "--max-tokens", str(a.new_tokens), "--data", str(Path(a.data).resolve())],
             lambda r: r.get("drafter") not in (None, "none")),
}


def bench_command(tree: Path, mode: str, args, engine: list, out: Path) -> list[str]:
    """The command of one side's bench: the tree's own script, its mode's arguments and the side's settings. A tree
    with bench/<group>/<script>.py runs it as `-m bench.<group>.<script>` (from the tree, its cwd); an older checkout
    with the flat layout, as the file bench/<script>.py."""
    script, *rest = MODES[mode][0](args)
    if OPEN_FLAG in rest and not _knows_open(tree):
        rest.remove(OPEN_FLAG)
    if (tree / "bench" / script).is_file():
        run = ["-m", "bench." + script.removesuffix(".py").replace("/", ".")]
    else:
        run = [str(tree / "bench" / Path(script).name)]
    return [sys.executable, *run, *rest, "--out", str(out), "--streams", *map(str, args.streams),
            *(["--model", args.model] if args.model else []), *(["--engine", *engine] if engine else [])]


def _knows_open(tree: Path) -> bool:
    """Whether the tree's guided bench has the guided-open mode (a tree from before the closing has not)."""
    script = next((p for p in (tree / "bench" / "guided" / "guided.py", tree / "bench" / "guided.py") if p.is_file()),
                  None)
    return script is not None and OPEN_FLAG in script.read_text()


def run_tree(tree: Path, mode: str, args, engine: list) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "t.json"
        env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        subprocess.run(bench_command(tree, mode, args, engine, out), cwd=tree, env=env, check=True)
        rows = [r for r in json.loads(out.read_text()) if MODES[mode][1](r)]
        if mode == "guided-open" and any(r["mode"] == "guided-open" for r in rows):
            rows = [r for r in rows if r["mode"] == "guided-open"]
        return [dict(r, ab_mode=mode) for r in rows]


HOST_BOUND = 0.10      # idle share of a step over which a side's run was host-bound


def main(argv=None):
    args = parse_args(argv)
    trees = {"before": Path(args.before).resolve(), "after": Path(args.after).resolve()}
    engines = {"before": args.before_engine, "after": args.after_engine}
    runs = {name: [] for name in trees}
    for r in range(args.rounds):
        for mode in args.modes:
            for name in (list(trees) if r % 2 == 0 else list(reversed(trees))):
                note(f"round {r + 1}/{args.rounds}, {mode}: {name} ({trees[name]} {' '.join(engines[name])})")
                runs[name] += run_tree(trees[name], mode, args, engines[name])
    records = [summarize(runs, mode, s, args, trees["before"]) for mode in args.modes for s in args.streams]
    write_results(records, args.out)
    print(write_markdown(records, str(args.out).rsplit(".", 1)[0] + ".md"))
    return records


def _median(values: list):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _idle(run: dict):
    """The compute stream's idle share of the run's step period, where its bench reports both."""
    if run.get("gpu_idle_ms") is None or not run.get("period_ms"):
        return None
    return run["gpu_idle_ms"] / run["period_ms"]


def _forward(run: dict):
    """The run's forward GPU ms a step: throughput's and spec's forward_gpu_ms, guided's forward_ms."""
    return run.get("forward_gpu_ms", run.get("forward_ms"))


def _differing(before, after):
    """'before / after' where both sides report a count and the counts differ, else None."""
    return f"{before:g} / {after:g}" if before is not None and after is not None and before != after else None


def summarize(runs: dict, mode: str, streams: int, args, before_tree: Path) -> dict:
    """One (mode, streams) row: each side's median tok/s, idle share, forward and time outside the engine's
    steps (throughput's outside_steps_ms) and in garbage collections (its gc_ms), after over before, host-bound
    sides."""
    pick = {n: [x for x in runs[n] if x["ab_mode"] == mode and x["streams"] == streams] for n in runs}
    tok = {n: [x["tok_s"] for x in rows if x.get("tok_s")] for n, rows in pick.items()}
    med = {n: _median(v) for n, v in tok.items()}

    def sides(value) -> dict:
        """Each side's median of value(run), over the runs that report it."""
        return {n: _median([value(x) for x in rows]) for n, rows in pick.items()}

    idle, forward = sides(_idle), sides(_forward)
    done = sides(lambda x: x.get("requests_done"))
    outside = sides(lambda x: x.get("outside_steps_ms"))
    gc_ms = sides(lambda x: x.get("gc_ms"))
    # each side's runs' five longest steps (bench.step.throughput's slowest_steps), one list a run
    slowest = {n: [x["slowest_steps"] for x in rows if x.get("slowest_steps")] for n, rows in pick.items()}
    ratio = med["after"] / med["before"] if med["after"] and med["before"] else None
    host_bound = " ".join(n for n in ("before", "after") if (idle[n] or 0.0) > HOST_BOUND) or None
    first = (pick["after"] or [{}])[0]
    return record("ab_throughput", mode, first.get("model"), first.get("dtype"), streams, args.new_tokens,
                  med["after"], first.get("ms_per_step"), before_tok_s=med["before"], after_over_before=ratio,
                  before_idle=idle["before"], after_idle=idle["after"], host_bound=host_bound,
                  before_forward_ms=forward["before"], after_forward_ms=forward["after"],
                  before_outside_ms=outside["before"], after_outside_ms=outside["after"],
                  before_gc_ms=gc_ms["before"], after_gc_ms=gc_ms["after"],
                  requests_done=_differing(done["before"], done["after"]),
                  before_runs=tok["before"], after_runs=tok["after"], before_tree=str(before_tree),
                  before_slowest_steps=slowest["before"], after_slowest_steps=slowest["after"],
                  before_engine=args.before_engine, after_engine=args.after_engine, rounds=args.rounds)


COLUMNS = ["mode", "streams", "before_tok_s", "tok_s", "after_over_before", "before_idle", "after_idle", "host_bound",
           "before_forward_ms", "after_forward_ms", "before_gc_ms", "after_gc_ms", "requests_done", "before_runs",
           "after_runs"]


def write_markdown(records: list[dict], path) -> str:
    r = records[0]
    sides = "".join(f", {side} settings {' '.join(r[f'{side}_engine'])}" for side in ("before", "after")
                    if r.get(f"{side}_engine"))
    text = (f"Command: `{r['command']}` on {r['device']}, after = commit {r['git_commit']}, before = "
            f"{r['before_tree']}{sides}; {r['model']} {r['dtype']}, {r['new_tokens']} new tokens, pipelined "
            f"(plain: EOS ignored); median of {r['rounds']} rounds (tok_s = after). idle: the compute stream's idle "
            f"share of a step; over {HOST_BOUND:.0%} a side was host-bound (host_bound), and its ratio measures that "
            "run's host; forward: the median forward GPU ms a step, the GPU's own measure; gc: ms of Python's "
            "collections inside the timed run, in its tok/s (a tree whose bench does not freeze the heap before it "
            "may collect where the other does not)."
            "\n\n" + markdown_table(records, COLUMNS))
    Path(path).write_text(text + "\n")
    return text


if __name__ == "__main__":
    main()
