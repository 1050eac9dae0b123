"""Speculative decoding: acceptance length per drafter, K and dataset, and tokens/s with vs without.

    python -m bench.spec.spec                                         # both parts, default model, CUDA
    python -m bench.spec.spec --only acceptance --drafters ngram --k 1 2 3 4 5 --datasets JME BFCL chat
    python -m bench.spec.spec --only acceptance --datasets mine=prompts.jsonl myschemas=path/to/dir
    python -m bench.spec.spec --only speed --streams 1 8 32 --k 3 --datasets JME
    python -m bench.spec.spec --only speed --streams 1 --k 4 --datasets chat --drafters eagle \
        --variants whole: v16k:spec_draft_vocab=specdec/heads/smollm2-135m/token_ranks.json,spec_draft_vocab_size=16384

Acceptance: specdec.acceptance's study (docs/acceptance.md; `python -m specdec.acceptance` has more options):
one engine per (drafter, K) with every step speculating (spec_max_batch = batch, spec_min_acceptance 0), greedy,
the prompts of each dataset run to EOS or --max-tokens; acceptance length = tokens per verifying row-step, the
target's own token included (the TensorRT-LLM guided + speculative article's Table 1 metric: K = 3 gives at most 4).
Speed: per stream count (max_num_seqs = streams, a queue of max(4 x streams, --min-prompts) prompts), the same
prompts through the engine without speculation ("none") and with each drafter / K (/ --variants), alternating
over --rounds; greedy, so every mode emits the same tokens. tok_s = output tokens
/ wall; speedup = tok_s over "none" of the same round set. The engine's batch-level policy (EngineConfig
spec_max_batch, or --engine spec_max_batch=N) decides when a step speculates; spec_frac = share of row-steps that
verified drafts, quiet_frac = share of steps that drafted nothing (a paused engine's plain steps), leaf_frac = share
of spec row-steps whose last accepted draft was a tree's leaf (--variants NAME:spec_tree=N), level_frac = share of
spec row-steps at each level the draft budget chose ({drafts a row holds: share}; a tree engine's largest is its tree),
budget_rates / budget_costs_ms = the budget's pass rates by position and step costs at the run's end.
Datasets: JME / BFCL (schemas under --data: prompt "produce JSON matching this schema"), chat (specdec/datasets.py's
questions), NAME=PATH for a directory of schemas in the same format or a JSONL of {"prompt"} / {"messages"}.
Writes JSON records (common keys + drafter, k, dataset, acceptance_length, tok_s, speedup), markdown, and a
PNG of acceptance length vs K.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from bench.common import (chat_prompts, cuda_sync, engine_kwargs, engine_overrides, markdown_table, note,
                          parse_variants, plot, record, write_results)
from bench.guided.guided_quality import (DATASETS, close_engines, load_schemas, resolve,
                                         schema_prompt)

ACC_COLUMNS = ["drafter", "k", "dataset", "prompts", "new_tokens", "acceptance_length", "rate_by_position",
               "tok_s"]
SPEED_COLUMNS = ["streams", "drafter", "k", "variant", "dataset", "tok_s", "speedup", "acceptance_length",
                 "spec_frac", "quiet_frac", "leaf_frac", "level_frac", "ms_per_step"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["acceptance", "speed"], default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--data", default=os.environ.get("SPECDEC_DATA", "../shared/data") + "/jsonschemabench")
    p.add_argument("--datasets", nargs="+", default=["JME", "BFCL", "chat"])
    p.add_argument("--drafters", nargs="+", default=["ngram"])
    p.add_argument("--k", type=int, nargs="+", default=None, help="K values (acceptance: 1..5, speed: 3)")
    p.add_argument("--prompts", type=int, default=64, help="prompts per dataset (acceptance)")
    p.add_argument("--batch", type=int, default=32, help="rows per step (acceptance)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--min-prompts", type=int, default=16, help="speed: prompts per stream count, at least")
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--engine", nargs="*", default=[], help="EngineConfig overrides KEY=VALUE")
    p.add_argument("--variants", nargs="+", default=[], metavar="NAME:KEY=VALUE,...",
                   help="speed: every drafter / K also under each of these EngineConfig overrides, side by side in "
                        "the same rounds (NAME labels its rows; 'NAME:' alone is the engine as --engine gives it)")
    p.add_argument("--out", default="bench/results/spec.json")
    return p.parse_args(argv)


# ---- prompts -------------------------------------------------------------------------------------
def load_prompts(eng, item: str, root: str, limit: int) -> tuple[str, list[list[int]]]:
    name, _, path = item.partition("=")
    if name == "chat" and not path:
        return "chat", chat_prompts(eng, limit)
    if not path and name not in DATASETS:
        raise SystemExit(f"unknown dataset {name!r}: JME, BFCL, Glaive, Github_easy, chat or NAME=PATH")
    path = resolve(path or DATASETS[name], None if path else root)
    if path.endswith(".jsonl"):
        lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()][:limit]
        msgs = [d.get("messages") or [{"role": "user", "content": d["prompt"]}] for d in lines]
        return name, [eng.apply_chat_template(m) for m in msgs]
    return name.lower(), [schema_prompt(eng, schema) for _, schema in load_schemas(path, limit) if schema is not None]


def build(args, streams: int, drafter: str, k: int, variant: dict | None = None, **extra):
    from engine.llm_engine import LLMEngine
    # several engines live side by side (one per mode): KV pages for `streams` sequences of 2,048 tokens each,
    # not a share of free memory (the third engine's share left too little for its graphs)
    kw = engine_kwargs(args, dtype=args.dtype, depth=args.depth, max_num_seqs=streams,
                       enforce_eager=args.enforce_eager, num_kv_blocks=max(streams, 8) * 2048 // 16, block_size=16)
    if drafter != "none":
        kw.update(speculative=drafter, num_speculative_tokens=k, spec_max_batch=streams)
    return LLMEngine(**(kw | extra | engine_overrides(args) | (variant or {})))


def timed_generate(eng, prompts, max_tokens: int) -> dict:
    from engine.requests.sequence import SamplingParams
    eng.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0))     # warm-up (kernels, allocator)
    eng.timings.reset()
    cuda_sync()
    t0 = time.perf_counter()
    seqs = eng.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
    wall = time.perf_counter() - t0
    t = eng.timings
    tokens = sum(len(s.output_token_ids) for s in seqs)
    pos = [0] * eng.config.spec_k
    props = [0] * eng.config.spec_k
    for s in seqs:
        if s.spec is not None:
            for i, (a, p) in enumerate(zip(s.spec.by_position, s.spec.proposed_by_position)):
                pos[i] += a
                props[i] += p
    ms = t.per_step_ms()
    return dict(new_tokens=tokens, wall_s=wall, tok_s=tokens / wall, ms_per_step=1e3 * wall / max(t.steps, 1),
                steps=t.steps, period_ms=ms["period"], gpu_idle_ms=ms["gpu_idle"], forward_gpu_ms=ms["forward_gpu"],
                acceptance_length=round(t.acceptance_length, 4) if t.spec_rows else None,
                spec_frac=round(t.spec_rows / max(t.rows, 1), 4), quiet_frac=round(t.quiet_steps / max(t.steps, 1), 4),
                leaf_frac=round(t.spec_leaves / max(t.spec_rows, 1), 4),
                level_frac={k: round(n / t.spec_rows, 4) for k, n in sorted(t.spec_levels.items())},
                **budget_state(eng),
                rate_by_position=[round(a / p, 3) for a, p in zip(pos, props) if p],
                outputs=[s.output_token_ids for s in seqs])


def budget_state(eng) -> dict:
    """The draft budget's view after a run: its pass rate by position and its step costs (ms by "K,rows"), to set
    what it expected against what the run got."""
    policy = eng.scheduler.spec
    if policy is None:
        return {}
    b = policy.budget
    return dict(budget_rates=[round(b.rate(j), 3) for j in range(1, b.k + 1)],
                budget_costs_ms={f"{k},{rows}": round(1e3 * s, 4) for (k, rows), s in sorted(b.costs.items())})


# ---- parts -----------------------------------------------------------------------------------------
def run_acceptance(args) -> list[dict]:
    """specdec.acceptance's study (greedy, unguided, no "none" engine), in this bench's record format."""
    from specdec.acceptance import Study, run_study
    study = Study(datasets=args.datasets, drafters=args.drafters, ks=args.k or [1, 2, 3, 4, 5], guided=[False],
                  temperatures=[0.0], batch=args.batch, max_tokens=args.max_tokens, prompts=args.prompts,
                  model=args.model, device=args.device, dtype=args.dtype, data=args.data, baseline=False,
                  engine=dict(depth=args.depth, enforce_eager=args.enforce_eager) | engine_overrides(args))
    try:
        runs = run_study(study)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    records = []
    for r in runs:
        name = r["dataset"].lower() if r["dataset"] in DATASETS else r["dataset"]   # this bench's names: jme, bfcl
        records.append(record("spec", "acceptance", r["model"], args.dtype, args.batch, r["new_tokens"], r["tok_s"],
                              r["ms_per_step"], drafter=r["drafter"], k=r["k"], dataset=name, prompts=r["prompts"],
                              **{key: r[key] for key in ("wall_s", "steps", "acceptance_length", "spec_frac",
                                                         "rate_by_position")}))
        note(f"acceptance {r['drafter']} k={r['k']} {name}: {r['acceptance_length']}")
    return records


def run_speed(args, keep=None) -> list[dict]:
    """keep(records so far), after each (dataset, streams) cell: a run cut at its time limit leaves those."""
    records = []
    variants = parse_variants(args.variants)
    modes = [("none", 0, "")] + [(d, k, v) for d in args.drafters for k in (args.k or [3]) for v in variants]
    for streams in args.streams:
        # one engine per mode and stream count, used for every dataset in turn (builds and captures dominate)
        engines = {(d, k, v): build(args, streams, d, k, variants.get(v)) for d, k, v in modes}
        try:
            for item in args.datasets:
                # enough requests that the batch stays full: streams at a time from a queue of 4 x streams
                name, prompts = load_prompts(engines[modes[0]], item, args.data, max(4 * streams, args.min_prompts))
                runs = {m: [] for m in modes}
                for _ in range(args.rounds):
                    for m in modes:
                        runs[m].append(timed_generate(engines[m], prompts, args.max_tokens))
                base = max(r["tok_s"] for r in runs[modes[0]])
                ref = runs[modes[0]][0].pop("outputs")
                for m in modes:
                    best = max(runs[m], key=lambda r: r["tok_s"])
                    same = all([r.pop("outputs", ref) == ref for r in runs[m]])
                    rec = record("spec", "speed", engines[m].source.name, args.dtype, streams, best.pop("new_tokens"),
                                 best.pop("tok_s"), best.pop("ms_per_step"), drafter=m[0], k=m[1], variant=m[2],
                                 overrides=variants.get(m[2], {}), dataset=name,
                                 same_tokens_as_none=same, **best)
                    rec["speedup"] = round(rec["tok_s"] / base, 3)
                    records.append(rec)
                    note(f"speed {name} streams={streams} {m}: {rec['tok_s']:.0f} tok/s x{rec['speedup']}")
                if keep is not None:
                    keep(records)
        finally:
            close_engines(engines.values())
    return records


def main(argv=None):
    args = parse_args(argv)
    records = []
    if args.only in (None, "acceptance"):
        records += run_acceptance(args)
    if args.only in (None, "speed"):
        done = list(records)
        records += run_speed(args, keep=lambda speed: write_results(done + speed, args.out))
    out = write_results(records, args.out)
    acc = [r for r in records if r["mode"] == "acceptance"]
    speed = [r for r in records if r["mode"] == "speed"]
    md = [f"Command: `{records[0]['command'] if records else ''}` on {records[0]['device'] if records else '?'}, "
          f"commit {records[0]['git_commit'] if records else '?'}.", ""]
    if acc:
        for r in acc:
            r["curve"] = f"{r['drafter']} {r['dataset']}"
        plot(acc, "k", "acceptance_length", "curve", out.with_suffix(".png"), "acceptance length vs K (greedy)")
        md += ["### Acceptance length (tokens per verifying step, golden token included)", "",
               markdown_table(acc, ACC_COLUMNS), ""]
    if speed:
        md += ["### Tokens/s with and without speculation (same prompts, same run)", "",
               markdown_table(speed, SPEED_COLUMNS), ""]
        drafted = [r for r in speed if r["drafter"] != "none"]
        if len({r["k"] for r in drafted}) > 1:
            for r in drafted:
                name = " ".join(x for x in (r["drafter"], r["variant"], r["dataset"]) if x)
                r["curve"] = f"{name}, {r['streams']} streams"
            plot(drafted, "k", "speedup", "curve", out.with_name(out.stem + "_speedup.png"),
                 "tokens/s over no speculation vs K (same run)")
    text = "\n".join(md)
    out.with_suffix(".md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
