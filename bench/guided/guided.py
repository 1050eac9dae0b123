"""Guided decoding: per-step cost of grammar masks (guided vs free), output quality on JSONSchemaBench, and
transformers + xgrammar as a peer, in one run.

    python -m bench.guided.guided                            # all parts: default model, bf16, CUDA graphs
    python -m bench.guided.guided --only speed --streams 1 8 32 --rounds 3
    python -m bench.guided.guided --only quality --datasets JME BFCL --quality-limit 100
    python -m bench.guided.guided --only peer --peer-limit 20
    python -m bench.guided.guided --device cpu --dtype float32 --streams 1 2 --steps 8 --warm-steps 2 --rounds 1 \\
        --quality-limit 2 --peer-limit 1 --max-tokens 32 --out /tmp/guided_cpu.json    # smoke

Schemas come from --data (default ../shared/data/jsonschemabench, tried relative to the working directory,
then to the repository): JME = maskbench/JME_*.json, BFCL = maskbench/BFCL_*.json, Glaive =
raw/Glaiveai2K, Github_easy = raw/Github_easy; `NAME=PATH` adds any directory or glob of schema files.
`--largest 0.05` keeps the biggest 5% of each set's files (bytes), for speed and quality alike:

    python -m bench.guided.guided --only speed --streams 32 --schemas raw/Github_easy --largest 0.05

Speed (`--only speed`): guided steps against the same load unguided, in rounds of a closed loop; the method and
its fields are bench/guided/guided_speed.py's docstring. `--profile` adds one traced round of each mode (CUDA):
the kernels' critical path a step, beside the forward's GPU time.

Quality and peer: bench/guided/guided_quality.py's docstring. `--only` runs some parts and merges into an
existing --out (a new record replaces the old one of the same part, mode, streams and dataset). Writes
--out (JSON), a .md beside it (printed last) and a .png of period_ms guided vs free by streams.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import time
import traceback
from pathlib import Path

from bench.common import free_gpu_memory, markdown_table, note, plot, record, write_results
from bench.guided.guided_quality import (DATASETS, build_engine, close_engine, dataset_spec, load_schemas,
                                         run_peer, run_quality)
from bench.guided.guided_speed import COLUMNS as SPEED_COLS, run_speed

PARTS = ("speed", "quality", "peer")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--model", default=None, help="model spec (default: the default model)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default="auto", help="auto | cuda | cpu")
    p.add_argument("--depth", type=int, default=2, choices=[1, 2])
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--data", default="../shared/data/jsonschemabench", help="root of the default schema sets")
    p.add_argument("--schemas", default="maskbench/JME_*.json", help="speed: schema dir or glob (under --data)")
    p.add_argument("--speed-limit", type=int, default=None, help="speed: use the first N schemas")
    p.add_argument("--largest", type=float, default=None, metavar="FRAC",
                   help="speed and quality: only that share of each schema set, the biggest files")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--steps", type=int, default=1000, help="speed: committed steps timed per round")
    p.add_argument("--warm-steps", type=int, default=48, help="speed: steps of a round before the window")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--python-node", action="store_true",
                   help="speed: also run guided rounds on the Python grammar path (mode guided-python)")
    p.add_argument("--open-too", action="store_true",
                   help="speed: also guided rounds with close_at_budget and repetition_guard off (mode guided-open)")
    p.add_argument("--profile", action="store_true",
                   help="speed: one more round of each mode with its kernels traced (CUDA): path_ms")
    p.add_argument("--datasets", nargs="+", default=list(DATASETS), help="quality: NAME or NAME=PATH")
    p.add_argument("--quality-limit", type=int, default=None, help="quality: first N schemas per dataset")
    p.add_argument("--quality-seqs", type=int, default=64, help="quality: max_num_seqs")
    p.add_argument("--peer-dataset", default="JME")
    p.add_argument("--peer-limit", type=int, default=20)
    p.add_argument("--engine", nargs="*", default=[], metavar="KEY=VALUE",
                   help="EngineConfig overrides, e.g. grammar_threads=4 switch_interval=5e-5")
    p.add_argument("--out", default="bench/results/guided.json")
    return p.parse_args(argv)


# ---- quality / peer ---------------------------------------------------------------------------------------
def _with_engine(args, seqs, part, fn) -> list[dict]:
    eng = None
    try:
        eng = build_engine(args, seqs)
        return fn(eng)
    except Exception as e:                # noqa: BLE001
        traceback.print_exc()
        return [record("guided", "guided", args.model or "default", args.dtype, seqs, args.max_tokens, None, None,
                       part=part, error=f"{type(e).__name__}: {e}")]
    finally:
        close_engine(eng)
        eng = None
        free_gpu_memory()


def run_quality_all(args) -> list[dict]:
    if importlib.util.find_spec("jsonschema") is None:
        note("quality: jsonschema is not installed: outputs are not validated (valid_frac empty, `unchecked`)")

    def fn(eng):
        out = []
        for item in args.datasets:
            name, path = dataset_spec(item, args.data)
            try:
                out.append(run_quality(eng, name, load_schemas(path, args.quality_limit, args.largest), args))
            except Exception as e:        # noqa: BLE001 - the next dataset still runs
                traceback.print_exc()
                out.append(record("guided", "guided", eng.source.name, args.dtype, args.quality_seqs,
                                  args.max_tokens, None, None, part="quality", dataset=name,
                                  error=f"{type(e).__name__}: {e}"))
        return out
    # A whole set is added at once, so a schema's compile waits behind the others' (Github_easy: ~2,000 on 4
    # threads, some taking seconds). The engine's compile timeout counts that wait, as a server must; output
    # quality must not, so this part gives compiles 600 s unless --engine says otherwise.
    if not any(item.startswith("grammar_compile_timeout_s=") for item in args.engine):
        args = argparse.Namespace(**(vars(args) | {"engine": [*args.engine, "grammar_compile_timeout_s=600"]}))
    return _with_engine(args, args.quality_seqs, "quality", fn)


def run_peer_all(args) -> list[dict]:
    name, path = dataset_spec(args.peer_dataset, args.data)
    args.peer_dataset = name
    return _with_engine(args, 1, "peer", lambda eng: run_peer(eng, load_schemas(path, args.peer_limit), args))


# ---- output -----------------------------------------------------------------------------------------------
QUALITY_COLS = ["dataset", "schemas", "compiled_frac", "finished_frac", "valid_frac", "valid_fmt_frac",
                "schema_errors", "runtime_errors", "too_long", "mean_len", "tok_s", "wall_s", "callback_ms",
                "host_us_per_row", "compile_ms_p50", "compile_ms_p95", "compile_ms_max", "error"]
PEER_COLS = ["mode", "dataset", "schemas", "tok_s", "ms_per_step", "finished_frac", "valid_frac", "same_text_frac",
             "mean_len", "error"]


def write_markdown(records: list[dict], path) -> str:
    r = records[0]
    commits = sorted({x["git_commit"] for x in records})
    commands = "; ".join(f"`{c}`" for c in dict.fromkeys(x["command"] for x in records))
    parts = [f"Commands: {commands} on {r['device']}, commit {', '.join(commits)}; {r['model']} {r['dtype']}, "
             f"max_tokens {r['new_tokens']}, greedy, compact JSON. Method: bench/guided/guided.py's docstring."]
    for part, cols, title in (("speed", SPEED_COLS, "Speed: every row guided vs the same load unguided (ms per "
                               "step, medians over rounds)"), ("quality", QUALITY_COLS, "Quality (continuous "
                               "batching)"), ("peer", PEER_COLS, "Peer: transformers generate + xgrammar, batch 1")):
        rows = [x for x in records if x.get("part") == part]
        if rows:
            rows = sorted(rows, key=lambda x: (x.get("streams") or 0, x.get("mode") != "guided", x.get("mode")))
            parts.append(f"### {title}\n\n" + markdown_table(rows, [c for c in cols if any(c in x for x in rows)]))
    text = "\n\n".join(parts)
    Path(path).write_text(text + "\n")
    return text


def main(argv=None):
    args = parse_args(argv)
    records = []
    for part, fn in (("speed", run_speed), ("quality", run_quality_all), ("peer", run_peer_all)):
        if part in args.only:
            t0 = time.perf_counter()
            records += fn(args)
            note(f"{part}: {time.perf_counter() - t0:.0f} s")
    out = Path(args.out)
    if set(args.only) != set(PARTS) and out.exists():               # merge: a new record replaces its old one
        key = lambda x: (x.get("part"), x.get("mode"), x.get("streams"), x.get("dataset"))  # noqa: E731
        new = {key(x) for x in records}
        records = [x for x in json.loads(out.read_text()) if key(x) not in new] + records
    write_results(records, out)
    stem = str(out).rsplit(".", 1)[0]
    speed = [x for x in records if x.get("part") == "speed"]
    if speed:
        plot(speed, "streams", "period_ms", "mode", stem + ".png",
             f"guided vs free: ms per step ({speed[0]['model']}, depth {args.depth})")
    print(write_markdown(records, stem + ".md"))
    return records


if __name__ == "__main__":
    main()
