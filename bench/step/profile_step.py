"""Where a decode step's time goes: host phases per step and the GPU kernels of one step by kind.

    python -m bench.step.profile_step                               # default model, 1 and 32 streams
    PYTHONPATH=.old python -m bench.step.profile_step --tag before  # another tree's engine, same script
    python -m bench.step.profile_step --device cpu --dtype float32 --streams 2 --steps 4 --out /tmp/p.json  # smoke
    python -m bench.step.profile_step --streams 1 --tag eagle --engine speculative=eagle num_speculative_tokens=3 \
        spec_min_acceptance=0 spec_budget=false   # the speculative step at K (any EngineConfig field: --engine K=V)
    python -m bench.step.profile_step --streams 1 32 --rounds 2 --by-grid --variants ref:kernels=reference \
        auto: --resume --out $OUT/prof.json     # A/B in one run (cuBLAS, the measured routes); a cut run resumes
    python -m bench.step.profile_step --streams 32 --context 1024  # attention at an agent's context
    python -m bench.step.profile_step --streams 32 --by-grid --variants rule: bn32:gemm.3072.BLOCK_N=32 \
        w8:gemm.3072.num_warps=8      # decode_gemm's launch config for weights of 3,072 rows, in the step

Per stream count: one engine, every stream a chat prompt (of --context tokens or more) decoding with EOS
ignored. Once every prompt is prefilled and after --warmup-steps, the engine's own counters (engine/timings.py)
time --steps steps unprofiled: the host's plan, launch (replay: its graph's part), wait and commit per step,
the forward's and the sampling's GPU time, and the compute stream's idle time between steps.
Then torch.profiler records only device activity (no host ops, so the loop runs at its own pace) for
another --steps steps: kernels and copies per step, their time per step by kind, the kernels taking the most
time, and how much of the window the GPU was busy. Kernels inside CUDA graph replays are traced like any other.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from pathlib import Path

from bench.common import (bars, engine_overrides, markdown_table, note, parse_variants, record, stream_prompt,
                          write_results)
from bench.kernels.kernel_trace import device_events, kernel_summary, kernels_by_grid
from bench.step.throughput import build_engine

COLUMNS = ["tag", "variant", "round", "streams", "period_ms", "plan_ms", "launch_ms", "replay_ms", "wait_ms",
           "commit_ms", "forward_gpu_ms", "sample_gpu_ms", "gpu_idle_ms", "kernels", "kernel_us", "path_us",
           "busy_frac"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--warmup-steps", type=int, default=16)
    p.add_argument("--tag", default="", help="names the tree in the table (e.g. before / after)")
    p.add_argument("--out", default="bench/results/profile_step.json")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--engine", nargs="*", default=[], metavar="KEY=VALUE", help="further EngineConfig fields")
    p.add_argument("--context", type=int, default=0,
                   help="prompts of at least this many tokens (attention at agent-like contexts); 0: short prompts")
    p.add_argument("--top", type=int, default=15, help="kernels listed by time per step")
    p.add_argument("--variants", nargs="*", default=[], metavar="NAME:KEY=VALUE,...",
                   help="engine settings profiled side by side (bench/spec/spec.py's form), alternating in each round")
    p.add_argument("--rounds", type=int, default=1, help="profiles of each (streams, variant)")
    p.add_argument("--render", action="store_true", help="rewrite --out's markdown from its JSON; profile nothing")
    p.add_argument("--resume", action="store_true",
                   help="keep --out's records and run only the missing (streams, variant, round)s")
    p.add_argument("--by-grid", action="store_true",
                   help="also list kernels by name and launch grid (each matmul shape apart) from the trace")
    return p.parse_args(argv)


def split_kernel_keys(overrides: dict) -> tuple[dict, dict]:
    """A variant's keys gemm.N.KEY (decode_gemm_config's KEY for weights of N rows), gemm.NxK.KEY (for weights
    of N rows of K) or head.KEY (head_mma's head_config) apart from EngineConfig's: (engine overrides, {N, (N, K) or
    "head": {KEY: value}})."""
    engine, kernels = {}, {}
    for key, value in overrides.items():
        if key.startswith("head."):         # head.KEY: head_mma's config (where the route table runs it)
            kernels.setdefault("head", {})[key[5:]] = value
            continue
        if not key.startswith("gemm."):
            engine[key] = value
            continue
        _, shape, name = (key.split(".", 2) + ["", ""])[:3]
        dims = shape.split("x")
        if not name or len(dims) > 2 or not all(d.isdigit() for d in dims):
            raise ValueError(f"{key!r}: a decode_gemm override is gemm.<weight rows>[x<row length>].<config key>")
        kernels.setdefault(int(dims[0]) if len(dims) == 1 else tuple(map(int, dims)), {})[name] = value
    return engine, kernels


@contextlib.contextmanager
def kernel_configs(over: dict):
    """decode_gemm_config's choice replaced for the weights named in `over` ({N or (N, K): {KEY: value}}; a shape's
    keys over its N's), and head_mma's head_config by over["head"], while the block runs. Each launch reads the
    config, so an engine built and captured inside takes it."""
    from engine.kernels.matmul import decode_gemm, head_mma
    rule, head_rule = decode_gemm.decode_gemm_config, head_mma.head_config
    if over:
        decode_gemm.decode_gemm_config = (lambda m, n, k, decode=False:
                                          rule(m, n, k, decode) | over.get(n, {}) | over.get((n, k), {}))
        head_mma.head_config = lambda m, v, k: head_rule(m, v, k) | over.get("head", {})
    try:
        yield
    finally:
        decode_gemm.decode_gemm_config, head_mma.head_config = rule, head_rule


def profile(args, streams: int, overrides: dict | None = None) -> dict:
    extra, kernels = split_kernel_keys(engine_overrides(args) | (overrides or {}))
    with kernel_configs(kernels):
        return _profile(args, streams, extra)


def _profile(args, streams: int, extra: dict) -> dict:
    import torch
    from engine.requests.sequence import SamplingParams
    eng = build_engine(args, 2, streams, **extra)
    # a speculating step may emit K + 1 tokens: every stream must outlive the timed and the profiled steps
    total = (args.warmup_steps + 2 * args.steps + 8) * (eng.config.spec_k + 1)
    prompt_tokens = []
    for i in range(streams):        # chat prompts through the template every tree's engine has
        ids = stream_prompt(eng, i, args.context)
        prompt_tokens.append(len(ids))
        eng.add_request(ids, SamplingParams(max_tokens=total, temperature=0, ignore_eos=True))
    while eng.timings.tokens < streams and eng.has_unfinished():    # long prompts: prefilled before the warm-up
        eng.step()
    for _ in range(args.warmup_steps):
        eng.step()
    eng.timings.reset()
    for _ in range(args.steps):
        eng.step()
    host = {f"{k}_ms": v for k, v in eng.timings.per_step_ms().items()}
    host["tokens_per_step"] = eng.timings.tokens / max(eng.timings.steps, 1)
    kernels = {}
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                eng.step()
            torch.cuda.synchronize()
        kernels = kernel_summary(device_events(prof), args.steps, args.top)
        if args.by_grid:
            kernels["by_grid"] = kernels_by_grid(prof, args.steps, 2 * args.top)
    rec = record("profile_step", args.tag or "plain", eng.source.name, args.dtype, streams, None, None,
                 host["period_ms"], tag=args.tag, steps=args.steps, engine=extra,
                 prompt_tokens=statistics.mean(prompt_tokens), **host, **kernels)
    eng.close()
    return rec


def run_all(args) -> list[dict]:
    """Every (streams, round, variant) profile, the variants' order reversed in odd rounds; --out rewritten after
    each, so a run cut short resumes (--resume) where it stopped."""
    variants = parse_variants(args.variants)
    records = json.loads(Path(args.out).read_text()) if args.resume and Path(args.out).exists() else []
    done = {(r["streams"], r.get("variant", ""), r.get("round", 0)) for r in records}
    for n in args.streams:
        for rnd in range(args.rounds):
            for name, overrides in list(variants.items())[::-1 if rnd % 2 else 1]:
                if (n, name, rnd) in done:
                    continue
                r = profile(args, n, overrides) | dict(variant=name, round=rnd, overrides=overrides)
                records.append(r)
                write_results(records, args.out)
                note(f"{args.tag or 'plain'} {name} {n} streams: {r['period_ms']:.3f} ms/step, "
                     f"{r.get('kernels', 0):.0f} kernels")
    return records


def variant_summary(records) -> list[dict]:
    """Per (streams, variant): the median period, forward and kernels' critical path over rounds, and their ratios
    to the first variant's. The path is what a kernel change moves; a period or forward over it is GPU time left
    idle inside the step, where a slow host launch starves the GPU (such rounds flip the period, not the path)."""
    groups: dict[tuple, list] = {}
    for r in records:
        groups.setdefault((r["streams"], r.get("variant", "")), []).append(r)
    rows, first = [], {}
    for (n, name), rs in groups.items():
        period = statistics.median(r["period_ms"] for r in rs)
        path = statistics.median(r.get("path_us", 0.0) for r in rs) / 1e3
        first.setdefault(n, (period, path))
        rows.append(dict(streams=n, variant=name, rounds=len(rs), period_ms=period,
                         forward_gpu_ms=statistics.median(r.get("forward_gpu_ms", 0.0) for r in rs), path_ms=path,
                         x_first=period / first[n][0], path_x_first=path / first[n][1] if first[n][1] else None))
    return rows


def main(argv=None):
    args = parse_args(argv)
    if args.render:
        records = json.loads(Path(args.out).read_text())
        for r in records:          # records written before path_us was: the sum of their kinds' paths
            if r.get("kinds") and "path_us" not in r:
                r["path_us"] = sum(v["path_us_per_step"] for v in r["kinds"].values())
    else:
        records = run_all(args)
    render(records, Path(args.out))


def render(records: list[dict], out: Path) -> None:
    """The markdown beside --out: every profile, the variants' summary, each profile's kernels."""
    text = (f"Command: `{records[0]['command']}` on {records[0]['device']}, commit {records[0]['git_commit']}.\n\n"
            + markdown_table(records, COLUMNS))
    if len({r.get("variant", "") for r in records}) > 1:
        columns = ["streams", "variant", "rounds", "period_ms", "forward_gpu_ms", "path_ms", "x_first", "path_x_first"]
        summary = variant_summary(records)
        text += ("\n\nBy variant (medians over rounds; x_first: period over the first variant's; path: the kernels' "
                 "critical path a step):\n\n") + markdown_table(summary, columns)
        bars(summary, "streams", "variant", ["period_ms", "forward_gpu_ms", "path_ms"], out.with_suffix(".png"),
             f"{records[0].get('model', '')}: ms a step by variant")
    for r in records:
        if r.get("kinds"):
            rows = [dict(kind=k, **v) for k, v in r["kinds"].items()]
            text += f"\n\n{r['streams']} streams, per step by kernel kind:\n\n" + markdown_table(
                rows, ["kind", "per_step", "us_per_step", "path_us_per_step"])
            rows = [dict(kernel=f"`{k}`", **v) for k, v in r["top_kernels"].items()]
            text += (f"\n\n{r['streams']} streams, the kernels holding the most of the step's critical path "
                     "(path_us: how far each moves the latest end, in the order kernels end):\n\n") + markdown_table(
                rows, ["kernel", "per_step", "us_per_step", "path_us_per_step"])
        if r.get("by_grid"):
            rows = [dict(kernel=f"`{k}`", **v) for k, v in r["by_grid"].items()]
            text += f"\n\n{r['streams']} streams, kernels by name and launch grid:\n\n" + markdown_table(
                rows, ["kernel", "per_step", "us_per_step", "path_us_per_step"])
    with open(str(out).rsplit(".", 1)[0] + ".md", "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
