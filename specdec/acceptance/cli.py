"""`python -m specdec.acceptance` (also `specdec acceptance`): the study's options, then run, write, print."""
from __future__ import annotations

import argparse
import json
import shlex
import sys

from specdec.acceptance.report import write
from specdec.acceptance.study import DRAFTERS, Study, run_study
from specdec.datasets import CHAT, DATASETS

PROG = "python -m specdec.acceptance"
EXAMPLE = f"""example (CPU, a minute or two):
  {PROG} --datasets JME chat --drafters ngram --k 1 2 3 --prompts 4 --max-tokens 48 --device cpu --out /tmp/study
datasets: {', '.join([*DATASETS, CHAT])} (schemas under --data ROOT, by default tests/data), or NAME=PATH: a
directory of JSON schemas (bare or MaskBench's {{"schema": ...}}) or a JSONL of {{"prompt"}} / {{"messages"}}."""


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0 (0 = greedy), got {text!r}")
    return value


def _on_off(default: list[str]) -> dict:
    return dict(nargs="+", choices=["on", "off"], default=default, metavar="on|off")


def parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Acceptance-length study of the speculative drafters "
                                "(docs/acceptance.md).", epilog=EXAMPLE,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", nargs="+", default=["JME", "BFCL", CHAT], metavar="NAME|NAME=PATH")
    p.add_argument("--data", default=None, metavar="ROOT", help="holds maskbench/ (default: tests/data)")
    p.add_argument("--drafters", nargs="+", choices=DRAFTERS, default=["ngram"])
    p.add_argument("--head", nargs="+", default=[], metavar="DIR", help="eagle: head directories (default: the "
                   "shipped one); several are compared in one run, each its own method named after its directory")
    p.add_argument("--draft-model", default=None, metavar="SPEC", help="draft_model: a model spec sharing the "
                   "tokenizer (path, 'default', 'dummy:X')")
    p.add_argument("--k", type=_positive, nargs="+", default=[1, 2, 3], help="drafts per step (each its engine)")
    p.add_argument("--guided", **_on_off(["off", "on"]),
                   help="schema datasets decoded under their schema (chat never is)")
    p.add_argument("--draft-masks", **_on_off(["off"]),
                   help="guided draft masks (guided runs of eagle / draft_model only)")
    p.add_argument("--forced-drafts", **_on_off(["off"]),
                   help="grammar-forced drafts (guided runs of eagle / draft_model only)")
    p.add_argument("--temperature", type=_temperature, nargs="+", default=[0.0],
                   help="0 = greedy; > 0 sampled with per-prompt seeds (rejection sampling)")
    p.add_argument("--batch", type=_positive, default=8, help="max_num_seqs and spec_max_batch")
    p.add_argument("--max-tokens", type=_positive, default=128)
    p.add_argument("--prompts", type=_positive, default=16, help="prompts per dataset")
    p.add_argument("--model", default=None)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    p.add_argument("--seed", type=int, default=0, help="sampled runs: prompt i has seed SEED + i")
    p.add_argument("--no-baseline", action="store_true", help="skip the engine without speculation (no "
                   "same_tokens_as_none, no speedup)")
    p.add_argument("--engine", nargs="*", default=[], metavar="KEY=VALUE", help="further EngineConfig fields")
    p.add_argument("--out", default="acceptance", metavar="PREFIX", help="writes PREFIX.json/.md/.csv/.png")
    return p


def _engine_fields(items: list[str], p: argparse.ArgumentParser) -> dict:
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            p.error(f"--engine: {item!r} is not KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def study_from_args(args, p: argparse.ArgumentParser) -> Study:
    study = Study(datasets=args.datasets, drafters=list(dict.fromkeys(args.drafters)), ks=sorted(set(args.k)),
                  guided=[v == "on" for v in dict.fromkeys(args.guided)],
                  draft_masks=[v == "on" for v in dict.fromkeys(args.draft_masks)],
                  forced_drafts=[v == "on" for v in dict.fromkeys(args.forced_drafts)],
                  temperatures=list(dict.fromkeys(args.temperature)), batch=args.batch, max_tokens=args.max_tokens,
                  prompts=args.prompts, model=args.model, device=args.device,
                  dtype=None if args.dtype == "auto" else args.dtype, data=args.data,
                  heads=list(dict.fromkeys(args.head)),
                  draft_model=args.draft_model, baseline=not args.no_baseline, seed=args.seed,
                  engine=_engine_fields(args.engine, p))
    try:
        study.validate()
    except ValueError as e:
        p.error(str(e))
    return study


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser(prog)
    args = p.parse_args(argv)
    records = run_study(study_from_args(args, p))
    paths = write(records, args.out, " ".join([prog, shlex.join(argv)]))
    print(paths[".md"].read_text())
    print("wrote " + ", ".join(str(path) for path in paths.values()), file=sys.stderr)
    return 0
