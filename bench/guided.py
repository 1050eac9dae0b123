"""Guided decoding: per-step cost of grammar masks (guided vs free), output quality on JSONSchemaBench, and
transformers + xgrammar as a peer, in one run.

    python bench/guided.py                                   # all parts: default model, bf16, CUDA graphs
    python bench/guided.py --only speed --streams 1 8 32 --rounds 3
    python bench/guided.py --only quality --datasets JME BFCL --quality-limit 100
    python bench/guided.py --only peer --peer-limit 20
    python bench/guided.py --device cpu --dtype float32 --streams 1 2 --steps 8 --warm-steps 2 --rounds 1 \\
        --quality-limit 2 --peer-limit 1 --max-tokens 32 --out /tmp/guided_cpu.json    # smoke

Schemas come from --data (default ../shared/data/jsonschemabench, tried relative to the working directory,
then to the repository): JME = maskbench/JME_*.json, BFCL = maskbench/BFCL_*.json, Glaive =
raw/Glaiveai2K, Github_easy = raw/Github_easy; `NAME=PATH` adds any directory or glob of schema files.
`--largest 0.05` keeps the biggest 5% of each set's files (bytes), for speed and quality alike:

    python bench/guided.py --only speed --streams 32 --schemas raw/Github_easy --largest 0.05

Speed (`--only speed`): per --streams value, one engine with max_num_seqs = streams (--depth, CUDA graphs)
runs rounds of a closed loop: `streams` requests always in flight, request k of a round asking for schema
k % n of --schemas (JME; schemas that do not compile, or whose prompt does not fit, are left out), greedy,
--max-tokens cap. A finished request is replaced at once, so the batch stays full; rows that end on EOS and
the prefill of their replacements are part of the load. Each round runs --warm-steps steps, then
`timings.reset()` (so no step of the window follows a pause: its gpu_idle would measure the pause), then
--steps committed steps, then aborts what is left and drains.
- guided round: every request carries its JSON schema;
- free round: the same prompts without a guide, `ignore_eos=True`, and request k's max_tokens = the length
  of request k's output in the latest guided round (guides cannot be combined with ignore_eos, and the
  mirror gives both modes the same schedule: the same requests join and leave at the same steps).
A row that ends on EOS rides one more step as a zombie (depth 2), so a guided round finishes slightly fewer
requests per window: period is per step and unaffected, tok_s includes it. (A cached grammar is ready at
add_request, which waits up to 2 ms for its compile, so a guided request samples in its first step too.) One untimed guided + free round first (JIT, grammar cache,
the lengths), then --rounds rounds alternating the order (G F, F G, ...); each number is the median over
rounds. Fields (ms per committed step, means over the window unless `steady_`): period_ms =
`per_step_ms()["period"]` (host time inside step() per step); steady_period_ms = median step-to-step period
over decode steps with all rows busy (joins excluded); forward_ms, sample_ms and mask_wait_ms (compute
stream waiting for the mask after the forward) from CUDA events; callback_ms (host time inside the mask
callback; callback_p99_ms over steps), callback_delay_ms (tokens on the host -> callback start),
gpu_idle_ms (compute stream idle between steps) and idle_frac = gpu_idle / period; tok_s = tokens committed
in the window / its wall. guided_over_free = guided period / free period (target <= 1.03;
idle_frac target < 2%). On CPU there are no graphs and the CUDA-event times are 0.

Quality and peer: bench/guided_quality.py's docstring. `--only` runs some parts and merges into an
existing --out (a new record replaces the old one of the same part, mode, streams and dataset). Writes
--out (JSON), a .md beside it (printed last) and a .png of period_ms guided vs free by streams.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
import traceback
from pathlib import Path

try:                                      # imported as bench.guided, or run as a script
    from bench.common import markdown_table, note, plot, progress, record, write_results
    from bench.guided_quality import (DATASETS, build_engine, close_engine, dataset_spec, engine_overrides, free_engine,
                                      guided_params, load_schemas, resolve, run_peer, run_quality, schema_prompt)
except ImportError:
    from common import markdown_table, note, plot, progress, record, write_results
    from guided_quality import (DATASETS, build_engine, close_engine, dataset_spec, engine_overrides, free_engine, guided_params,
                                load_schemas, resolve, run_peer, run_quality, schema_prompt)

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
    p.add_argument("--datasets", nargs="+", default=list(DATASETS), help="quality: NAME or NAME=PATH")
    p.add_argument("--quality-limit", type=int, default=None, help="quality: first N schemas per dataset")
    p.add_argument("--quality-seqs", type=int, default=64, help="quality: max_num_seqs")
    p.add_argument("--peer-dataset", default="JME")
    p.add_argument("--peer-limit", type=int, default=20)
    p.add_argument("--engine", nargs="*", default=[], metavar="KEY=VALUE",
                   help="EngineConfig overrides, e.g. grammar_threads=4 switch_interval=5e-5")
    p.add_argument("--out", default="bench/results/guided.json")
    return p.parse_args(argv)


# ---- speed ----------------------------------------------------------------------------------------------
def speed_work(eng, args) -> list[tuple]:
    """(stem, prompt ids, guided params) of the speed schemas that compile and fit the context."""
    from engine.guided.compiler import GrammarService
    service = GrammarService(eng.tokenizer, eng.runner.vocab, eng.eos_ids)    # its own cache: the engine's stays cold
    work = []
    for stem, schema in load_schemas(resolve(args.schemas, args.data), args.speed_limit, args.largest):
        try:
            params = guided_params(schema, args.max_tokens)
            service.compile_now(params.guide)
            prompt = schema_prompt(eng, schema)
        except Exception as e:            # noqa: BLE001 - left out of the load
            note(f"speed: {stem} left out: {type(e).__name__}: {str(e)[:120]}")
            continue
        if len(prompt) + args.max_tokens <= eng.max_model_len:
            work.append((stem, prompt, params))
    service.close()
    if not work:
        raise RuntimeError("no speed schema compiled")
    return work


def _quantile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def run_round(eng, work, mode: str, streams: int, args, lengths: dict) -> dict:
    from engine.requests.sequence import SamplingParams
    free = {}

    def params(k):
        if mode.startswith("guided"):
            return work[k % len(work)][2]
        n = lengths.get(k, args.max_tokens)
        return free.setdefault(n, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))

    t, graphs = eng.timings, eng.runner.graphs
    active, k, tokens, done, errors, timed, t0 = {}, 0, 0, 0, 0, False, 0.0
    t.reset()
    while True:
        while len(active) < streams:
            active[eng.add_request(work[k % len(work)][1], params(k))] = k
            k += 1
        for out in eng.step():
            tokens += len(out.new_token_ids)
            if out.finished:
                kk = active.pop(out.request_id)
                done += timed
                errors += out.finish_reason == "error"
                if mode.startswith("guided") and out.finish_reason == "stop":
                    lengths[kk] = len(out.token_ids)
        if timed and t.steps >= args.steps:
            break
        if not timed and t.steps >= args.warm_steps:
            t.reset(trace=True)
            replays = dict(graphs.replays) if graphs else {}
            tokens, timed, t0 = 0, True, time.perf_counter()
    wall = time.perf_counter() - t0
    ms, trace = t.per_step_ms(), t.trace
    steady = [s for s in trace if s["decode"] and s["rows"] >= streams]
    med = lambda key: 1e3 * statistics.median(s[key] for s in steady) if steady else None  # noqa: E731
    res = dict(period_ms=ms["period"], wall_ms_per_step=1e3 * wall / t.steps, tok_s=tokens / wall,
               steady_period_ms=med("period"), steady_forward_ms=med("forward_gpu"),
               steady_mask_wait_ms=med("mask_wait_gpu"), steady_callback_ms=med("callback"),
               steady_gpu_idle_ms=med("gpu_idle"), forward_ms=ms["forward_gpu"], sample_ms=ms["sample_gpu"],
               mask_wait_ms=ms["mask_wait_gpu"], callback_ms=ms["callback"], callback_delay_ms=ms["callback_delay"],
               callback_p99_ms=1e3 * (_quantile([s["callback"] for s in trace], 0.99) or 0.0),
               gpu_idle_ms=ms["gpu_idle"], idle_frac=ms["gpu_idle"] / ms["period"],
               **{f"{c}_ms": ms[c] for c in ("plan", "launch", "wait", "commit")},
               steps=t.steps, steady_steps=len(steady), guided_steps=t.guided_steps, zombie_rows=t.zombie_rows,
               tokens=tokens, requests_done=done, errors=errors,
               graph_replays={key: v - replays.get(key, 0) for key, v in graphs.replays.items()} if graphs else None)
    for rid in list(active):
        eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    return res


def _aggregate(rounds: list[dict]) -> dict:
    out = {}
    for key, v in rounds[0].items():
        vals = [r[key] for r in rounds]
        if all(isinstance(x, int) and not isinstance(x, bool) for x in vals):
            out[key] = statistics.median_low(vals)
        elif all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in vals):
            out[key] = statistics.median(vals)
        else:
            out[key] = vals[-1]
    out["period_rounds"] = [r["period_ms"] for r in rounds]
    return out


def _round(eng, work, mode: str, streams: int, args, lengths: dict) -> dict:
    """One round; mode guided-python fills the masks on the Python path (xgrammar's Python API)."""
    masks = eng.runner.masks
    masks.python = mode == "guided-python"
    try:
        return run_round(eng, work, mode, streams, args, lengths)
    finally:
        masks.python = False


def run_speed(args) -> list[dict]:
    records, work = [], None
    for streams in progress(args.streams, "speed (streams)"):
        t0, eng = time.perf_counter(), None
        try:
            eng = build_engine(args, streams)
            note(f"streams={streams}: engine ready in {time.perf_counter() - t0:.1f} s, graphs "
                 f"{'off' if eng.runner.graphs is None else eng.runner.graphs.sizes}")
            work = work or speed_work(eng, args)
            lengths: dict[int, int] = {}
            modes = ("guided", "free") + (("guided-python",) if args.python_node else ())
            for mode in modes:                                    # untimed: JIT, grammar cache, lengths
                _round(eng, work, mode, streams, args, lengths)
            rounds = {m: [] for m in modes}
            for r in range(args.rounds):
                for mode in (modes if r % 2 == 0 else modes[::-1]):
                    rounds[mode].append(_round(eng, work, mode, streams, args, lengths))
            agg = {m: _aggregate(v) for m, v in rounds.items()}
            f = agg["free"]
            for m in modes:
                if m.startswith("guided"):
                    g = agg[m]
                    ratio = lambda key: g[key] / f[key] if g[key] and f[key] else None  # noqa: E731
                    g.update(guided_over_free=ratio("period_ms"), steady_guided_over_free=ratio("steady_period_ms"),
                             tok_s_guided_over_free=ratio("tok_s"), host_us_per_row=1e3 * g["callback_ms"] / streams)
            g = agg["guided"]
            for mode, a in agg.items():
                records.append(record("guided", mode, eng.source.name, str(eng.runner.dtype).replace("torch.", ""),
                                      streams, args.max_tokens, a.pop("tok_s"), a["period_ms"], part="speed",
                                      depth=args.depth, graphs=eng.runner.graphs is not None, rounds=args.rounds,
                                      schemas=len(work), dataset=args.schemas,
                                      engine_config=engine_overrides(args), **a))
            note(f"streams={streams}: period guided {g['period_ms']:.3f} / free {f['period_ms']:.3f} ms = "
                 f"{g['guided_over_free'] or float('nan'):.3f}x, idle {100 * g['idle_frac']:.2f}% "
                 f"({time.perf_counter() - t0:.0f} s)")
        except Exception as e:            # noqa: BLE001 - one failing streams value must not end the sweep
            traceback.print_exc()
            records.append(record("guided", "guided", args.model or "default", args.dtype, streams, args.max_tokens,
                                  None, None, part="speed", error=f"{type(e).__name__}: {e}"))
        close_engine(eng)
        eng = None
        free_engine()
    return records


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
        free_engine()


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
SPEED_COLS = ["streams", "mode", "period_ms", "guided_over_free", "steady_period_ms", "steady_guided_over_free",
              "tok_s", "forward_ms", "mask_wait_ms", "callback_ms", "callback_p99_ms", "host_us_per_row", "callback_delay_ms",
              "gpu_idle_ms", "idle_frac", "requests_done", "error"]
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
             f"max_tokens {r['new_tokens']}, greedy, compact JSON. Method: bench/guided.py's docstring."]
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
