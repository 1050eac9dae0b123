"""How often a chain engine's draft budget moves up a level, and what those steps cost: a model, not a timing.

    python -m bench.spec.level_moves --prompts 12 --max-tokens 200
    python -m bench.spec.level_moves --costs 0:0.49 1:0.63 3:0.68 6:0.82 --out /tmp/moves.json

A chain step of level K drafts K for the next step, so a step that moves up a level verifies the lower level's
drafts at the higher level's cost. This runs one stream of the engine (greedy, chat prompts, the shipped EAGLE head,
K = 6; the CPU will do) with one-stream step costs handed to its draft budget (ms by level, 0 the plain step; the
defaults are the budget's own timings on an H100, bench/results/spec_policy/ "Verification attention"), so that it
picks levels as on that GPU. It records each step's level and the drafts its row verified, and models the time:
the steps' costs summed (`model_ms`), and of that, what the steps holding fewer drafts than their level paid over
the highest level those drafts fill (`short_ms`). Rows near their max_tokens also verify fewer drafts; they are
counted as well, so `short_ms` bounds the moves' cost from above.
"""
from __future__ import annotations

import argparse
from collections import Counter

from bench.common import markdown_table, progress, record, write_results

COSTS_MS = {0: 0.4895, 1: 0.6293, 3: 0.6815, 6: 0.8219}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--costs", nargs="+", default=[f"{k}:{v}" for k, v in COSTS_MS.items()],
                   help="LEVEL:MS of a one-stream step, for 0 (plain) and every level of K = 6 (1, 3, 6)")
    p.add_argument("--out", default="level_moves.json")
    return p.parse_args(argv)


def costs_of(items: list[str]) -> dict[int, float]:
    costs = {}
    for item in items:
        level, sep, ms = item.partition(":")
        if not sep or not level.isdigit() or float(ms) <= 0:
            raise ValueError(f"a cost is LEVEL:MS with MS positive, got {item!r}")
        costs[int(level)] = float(ms)
    return costs


def run(args) -> dict:
    from engine.llm_engine import LLMEngine
    from engine.requests.sequence import SamplingParams
    from specdec.datasets import chat_prompts
    costs = costs_of(args.costs)
    kw = dict(device="cpu", dtype="float32", speculative="eagle", num_speculative_tokens=6, max_num_seqs=1)
    eng = LLMEngine(**kw | ({"model": args.model} if args.model else {}))
    budget = eng.scheduler.spec.budget
    if set(costs) != {0, *budget.levels}:
        raise ValueError(f"--costs must give levels 0 and {budget.levels}, got {sorted(costs)}")
    budget.set_costs({(k, 1): ms / 1e3 for k, ms in costs.items()})
    steps = []                                  # (level, drafts verified, drafts accepted); level 0: plain
    commit = eng.commits.step

    def recorded(rows, tokens, *a, spec=False, **kw):
        for row in rows:
            if row.sample:
                entry = tokens[row.sample_idx]
                k = row.spec_k if spec else 0
                steps.append((k, entry[-1] if k else 0, sum(t >= 0 for t in entry[1:k + 1]) if k else 0))
        return commit(rows, tokens, *a, spec=spec, **kw)

    eng.commits.step = recorded
    for prompt in progress(chat_prompts(eng, args.prompts), "prompts"):
        eng.generate([prompt], [SamplingParams(max_tokens=args.max_tokens, temperature=0.0)])
    eng.close()
    filled = sorted(costs)
    short = [(k, d) for k, d, _ in steps if k and d < k]
    short_ms = sum(costs[k] - costs[max(level for level in filled if level <= d)] for k, d in short)
    model_ms = sum(costs[k] for k, _, _ in steps)
    tokens = sum(1 + a for _, _, a in steps)
    moves = sum(1 for (a, _, _), (b, _, _) in zip(steps, steps[1:]) if 0 < a < b)
    return record("level_moves", "eagle", eng.source.name, "float32", 1, args.max_tokens, None,
                  model_ms / max(len(steps), 1), steps=len(steps), levels=dict(Counter(k for k, _, _ in steps)),
                  short_steps=len(short), moves_up=moves, tokens=tokens, model_ms=model_ms, short_ms=short_ms,
                  short_frac=short_ms / model_ms if model_ms else 0.0,
                  speedup_model=tokens * costs[0] / model_ms if model_ms else 0.0, costs_ms=costs,
                  prompts=args.prompts)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    records = [run(args)]
    write_results(records, args.out)
    print(markdown_table(records, ["steps", "levels", "moves_up", "short_steps", "model_ms", "short_ms", "short_frac",
                                   "speedup_model"]))
    return records


if __name__ == "__main__":
    main()
