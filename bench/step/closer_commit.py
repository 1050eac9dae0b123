"""A guided row's share of the native commit: its closer's repetition check, per committed token, on the CPU.

    python -m bench.step.closer_commit --tag after
    PYTHONPATH=<old tree> python bench/step/closer_commit.py --tag before     # another tree's engine

The native commit walk (engine/requests/csrc/commit_walk.cpp) asks each guided row's closer whether its new token
changes the repetition guard (Closer.committed), one call of `_hostpath.closer_committed` here. Three loads, each
token committed by that call with the closer of a real guided request (the default model's tokenizer, the first
JSON Mode Eval schema of tests/data): `json`, the valid instances of the JSON Mode Eval schemas of tests/data
tokenized, one output each, token by token (the mix of a JSON output: a token that repeats one of the eight
before it takes the guard's scan); `distinct`, tokens that never repeat (the quick check alone); `repeat`, a token
that repeats one before it (the scan). Each is also timed with no closer, calls that return at once: `ns_net` is
a load's time less that, what the native walk pays (it makes no Python call). Nanoseconds a token, the best of
--rounds rounds.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.common import REPO, markdown_table, note, record, write_results

SCHEMAS = "tests/data/maskbench/JME_*.json"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=20000, help="calls a round of the distinct, repeat and call loads")
    p.add_argument("--tag", default="", help="names the tree (e.g. before / after)")
    p.add_argument("--out", default="bench/results/closer_commit.json")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.calls < 1:
        raise ValueError("--rounds and --calls must be positive")
    return args


def real_closer():
    """(engine, the closer of a guided request of the first JSON Mode Eval schema, that schema's instances)."""
    from engine.llm_engine import LLMEngine
    from engine.requests.sequence import SamplingParams
    docs = [json.loads(p.read_text()) for p in sorted(REPO.glob(SCHEMAS))]
    eng = LLMEngine(device="cpu", dtype="float32", max_num_seqs=2)
    rid = eng.add_request(eng.tokenizer.encode("Reply in JSON."),
                          SamplingParams(max_tokens=256, json_schema=docs[0]["schema"], close_at_budget=True))
    for _ in range(3):
        eng.step()
    closer = eng._seqs[rid].closer
    if closer is None or not closer.guard_limit:
        raise RuntimeError("the guided request has no closer with its repetition guard on")
    texts = [json.dumps(t["data"]) for d in docs for t in d.get("tests", [])[:1] if t.get("valid")]
    return eng, closer, [eng.tokenizer.encode(t, add_special_tokens=False) for t in texts]


def _fresh(closer) -> None:
    closer.runs, closer.quiet, closer.watch, closer.repeating, closer.forced = [0] * len(closer.runs), True, False, \
        False, []


def time_json(call, closer, outputs: list[list[int]]) -> float:
    """ns a token, each output's tokens committed one by one (the guard reset between outputs); with closer None,
    the same loop of calls that return at once."""
    total = n = 0
    for ids in outputs:
        if closer is not None:
            _fresh(closer)
        out = []
        t0 = time.perf_counter_ns()
        for token in ids:
            out.append(token)
            call(closer, out)
            if closer is not None:
                closer.repeating = False    # a firing would end the checks; the load measures them
        total += time.perf_counter_ns() - t0
        n += len(ids)
    return total / n


def time_loop(call, closer, out: list[int], calls: int, reset: bool) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        if reset:
            _fresh(closer)
        call(closer, out)
    spent = time.perf_counter_ns() - t0
    if reset:                               # less the resets alone
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            _fresh(closer)
        spent -= time.perf_counter_ns() - t0
    return spent / calls


def net(best: dict) -> dict:
    """Each load's ns less its loop's calls that return at once (what the native walk does not pay)."""
    return {"json": best["json"] - best["json_call"], "distinct": best["distinct"] - best["call"],
            "repeat": best["repeat"] - best["call"]}


def main(argv=None):
    args = parse_args(argv)
    from engine.requests import _hostpath
    eng, closer, outputs = real_closer()
    call = _hostpath.closer_committed
    distinct = list(range(1000, 1050))
    loads = {"json": lambda: time_json(call, closer, outputs),
             "json_call": lambda: time_json(call, None, outputs),
             "distinct": lambda: (_fresh(closer), time_loop(call, closer, distinct, args.calls, False))[1],
             "repeat": lambda: time_loop(call, closer, distinct + [distinct[-3]], args.calls, True),
             "call": lambda: time_loop(call, None, distinct, args.calls, False)}
    best = {name: min(fn() for _ in range(args.rounds)) for name, fn in loads.items()}
    eng.close()
    rec = record("closer_commit", args.tag or "tree", "default", "float32", 1, sum(map(len, outputs)), None, None,
                 tag=f"closer_commit_{args.tag}" if args.tag else "closer_commit",
                 ns_per_call=best, ns_net=net(best))
    write_results([rec], Path(args.out))
    rows = [dict(tag=args.tag, load=k, ns=round(best[k]), ns_net=round(v)) for k, v in net(best).items()]
    note(f"{len(outputs)} outputs, {sum(map(len, outputs))} tokens")
    print(markdown_table(rows, ["tag", "load", "ns", "ns_net"]))


if __name__ == "__main__":
    main()
