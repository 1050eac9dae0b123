"""bench/guided/guided.py's speed part: guided steps against the same load unguided, in rounds of a closed loop.

Per --streams value, one engine with max_num_seqs = streams (--depth, CUDA graphs) runs rounds of a closed loop:
`streams` requests always in flight, request k of a round asking for schema k % n of --schemas (JME; schemas
that do not compile, or whose prompt does not fit, are left out), greedy, --max-tokens cap. A finished request
is replaced at once, so the batch stays full; rows that end on EOS and the prefill of their replacements are
part of the load. Each round runs --warm-steps steps, then `timings.reset()` (so no step of the window follows
a pause: its gpu_idle would measure the pause), then --steps committed steps, then aborts what is left and
drains.
- guided round: every request carries its JSON schema;
- free round: the same prompts without a guide, `ignore_eos=True`, and request k's max_tokens = the length
  of request k's output in the latest guided round (guides cannot be combined with ignore_eos, and the
  mirror gives both modes the same schedule: the same requests join and leave at the same steps).
A row that ends on EOS rides one more step as a zombie (depth 2), so a guided round finishes slightly fewer
requests per window: period is per step and unaffected, tok_s includes it. (A cached grammar is ready at
add_request, which waits up to 2 ms for its compile, so a guided request samples in its first step too.) One
untimed guided + free round first (JIT, grammar cache, the lengths), then --rounds rounds alternating the order
(G F, F G, ...); each number is the median over rounds. Fields (ms per committed step, means over the window
unless `steady_`): period_ms = `per_step_ms()["period"]` (host time inside step() per step); steady_period_ms =
median step-to-step period over decode steps with all rows busy (joins excluded); forward_ms, sample_ms and
mask_wait_ms (compute stream waiting for the mask after the forward) from CUDA events; callback_ms (host time
inside the mask callback; callback_p99_ms over steps), callback_delay_ms (tokens on the host -> callback
start), gpu_idle_ms (compute stream idle between steps) and idle_frac = gpu_idle / period; plan_ms, launch_ms
and commit_ms (the host's phases); gc_ms (Python's garbage collections inside the window, all of them, and
gc_count by generation); tok_s = tokens committed in the window / its wall. guided_over_free = guided
period / free period (target <= 1.03; idle_frac target < 2%). On CPU there are no graphs and the CUDA-event
times are 0.

`--open-too`: one more guided mode, guided-open, with close_at_budget and repetition_guard off: the closing's own
cost is guided's period over guided-open's (their outputs end at different points, so the loads differ somewhat).

`--profile` (CUDA): after the rounds, one more round of each mode with its window's kernels traced: path_ms is
their critical path a step (bench/step/profile_step.py's path_us), and the record's `profile` holds the kernels by
kind. A forward over path_ms is GPU time left idle inside the step.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
import traceback

from bench.common import GcClock, dtype_name, engine_overrides, free_gpu_memory, note, progress, record
from bench.guided.guided_quality import (build_engine, close_engine, guided_params,
                                         load_schemas, resolve, schema_prompt)
from bench.kernels.kernel_trace import device_events, kernel_summary

COLUMNS = ["streams", "mode", "period_ms", "guided_over_free", "steady_period_ms", "steady_guided_over_free",
           "tok_s", "forward_ms", "path_ms", "mask_wait_ms", "callback_ms", "callback_p99_ms", "host_us_per_row",
           "callback_delay_ms", "plan_ms", "launch_ms", "commit_ms", "gpu_idle_ms", "idle_frac", "gc_ms",
           "requests_done", "error"]


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


def run_round(eng, work, mode: str, streams: int, args, lengths: dict, prof=None) -> dict:
    """One round (the module's docstring); `prof`: a torch profiler started and stopped around the window."""
    from engine.requests.sequence import SamplingParams
    free, opened = {}, {}

    def params(k):
        if mode == "guided-open":       # the closing's own cost: the same guides, never closed
            p = work[k % len(work)][2]
            return opened.setdefault(id(p), dataclasses.replace(p, close_at_budget=False, repetition_guard=False))
        if mode.startswith("guided"):
            return work[k % len(work)][2]
        n = lengths.get(k, args.max_tokens)
        return free.setdefault(n, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))

    t, graphs = eng.timings, eng.runner.graphs
    active, k, tokens, done, errors, timed, t0 = {}, 0, 0, 0, 0, False, 0.0
    t.reset()
    with GcClock() as gc_clock:     # Python's collections inside the window (cleared at its start)
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
                    if mode == "guided" and out.finish_reason == "stop":
                        lengths[kk] = len(out.token_ids)
            if timed and t.steps >= args.steps:
                break
            if not timed and t.steps >= args.warm_steps:
                _window(prof, "start")
                t.reset(trace=True)
                gc_clock.pauses.clear()
                replays = dict(graphs.replays) if graphs else {}
                tokens, timed, t0 = 0, True, time.perf_counter()
        wall = time.perf_counter() - t0
    _window(prof, "stop")
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
               tokens=tokens, requests_done=done, errors=errors, gc_ms=gc_clock.ms, gc_count=gc_clock.count,
               graph_replays={key: v - replays.get(key, 0) for key, v in graphs.replays.items()} if graphs else None)
    for rid in list(active):
        eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    return res


def _window(prof, action: str) -> None:
    """Start or stop the profiler at the window's edge, the device drained first."""
    if prof is not None:
        import torch
        torch.cuda.synchronize()
        getattr(prof, action)()


def profiled(eng, work, mode: str, streams: int, args, lengths: dict) -> dict:
    """One more round with the kernels of its window traced (CUDA only; apart from the timed rounds, whose host
    times the profiler would slow): kernels, their time and critical path a step (bench/step/profile_step.py)."""
    import torch
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    res = _round(eng, work, mode, streams, args, lengths, prof)
    summary = kernel_summary(device_events(prof), max(res["steps"], 1), top=10)
    return dict(path_ms=summary["path_us"] / 1e3, profile=summary | dict(period_ms=res["period_ms"]))


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


def _round(eng, work, mode: str, streams: int, args, lengths: dict, prof=None) -> dict:
    """One round; mode guided-python fills the masks on the Python path (xgrammar's Python API)."""
    masks = eng.runner.masks
    masks.python = mode == "guided-python"
    try:
        return run_round(eng, work, mode, streams, args, lengths, prof)
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
            modes = ("guided", "free") + (("guided-python",) if args.python_node else ()) + \
                (("guided-open",) if args.open_too else ())
            for mode in modes:                                    # untimed: JIT, grammar cache, lengths
                _round(eng, work, mode, streams, args, lengths)
            rounds = {m: [] for m in modes}
            for r in range(args.rounds):
                for mode in (modes if r % 2 == 0 else modes[::-1]):
                    rounds[mode].append(_round(eng, work, mode, streams, args, lengths))
            agg = {m: _aggregate(v) for m, v in rounds.items()}
            if args.profile and eng.runner.cuda:
                for mode in modes:
                    agg[mode].update(profiled(eng, work, mode, streams, args, lengths))
            f = agg["free"]
            for m in modes:
                if m.startswith("guided"):
                    g = agg[m]
                    ratio = lambda key: g[key] / f[key] if g[key] and f[key] else None  # noqa: E731
                    g.update(guided_over_free=ratio("period_ms"), steady_guided_over_free=ratio("steady_period_ms"),
                             tok_s_guided_over_free=ratio("tok_s"), host_us_per_row=1e3 * g["callback_ms"] / streams)
            g = agg["guided"]
            for mode, a in agg.items():
                records.append(record("guided", mode, eng.source.name, dtype_name(eng),
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
        free_gpu_memory()
    return records
