"""The served bench's requests run through the engine in-process, without the server: the rate the API
processes are measured against (serve.py --engine-too).

The same request list as the served runs, at the same concurrency (closed loop: C requests in flight, one
replaced as it finishes), with the same sampling: greedy, chat at --max-tokens (EOS ignored with
--fixed-length), JSON under its schema at --json-max-tokens. Prompts take the model's chat template, as the
server's do. A request the engine refuses (a schema it cannot enforce) counts as an error, as the server's 400
does. out_tok_s = output tokens / wall time from the first request to the last token.
"""
from __future__ import annotations

import time

from bench.common import note
from bench.serving.serve_client import warm_set


def engine_config(args) -> dict:
    """The EngineConfig fields `specdec serve` gets from serve.py's flags."""
    fields = dict(model=args.model, max_num_seqs=args.max_num_seqs or max(args.concurrency or [32]))
    if args.speculative != "none":
        fields.update(speculative=args.speculative, num_speculative_tokens=args.num_draft_tokens)
    return fields


def params_for(req: dict, args):
    """The request's SamplingParams, or the ValueError a schema the engine cannot enforce raises."""
    from engine.requests.sequence import SamplingParams
    if req["kind"] == "chat":
        return SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=args.fixed_length)
    try:
        return SamplingParams(max_tokens=args.json_max_tokens, temperature=0.0, json_schema=req["schema"])
    except ValueError as e:
        return e


def closed_run(eng, jobs: list, concurrency: int) -> dict:
    """jobs: (prompt ids, params or the ValueError that refused them); keeps `concurrency` in flight. Returns the
    run's counts."""
    queue, active = list(jobs), set()
    out_tokens = ok = errors = 0
    eng.timings.reset()
    t0 = time.perf_counter()
    while queue or active:
        while queue and len(active) < concurrency:
            ids, params = queue.pop(0)
            if isinstance(params, ValueError):
                errors += 1
                continue
            try:
                active.add(eng.add_request(ids, params, retain=True, detokenize=False))
            except ValueError:
                errors += 1
        for out in eng.step():
            if out.finished:
                active.discard(out.request_id)
                seq = eng.take(out.request_id)
                out_tokens += len(seq.output_token_ids)
                failed = seq.finish_reason not in ("stop", "length")
                errors, ok = errors + failed, ok + (not failed)
    wall, t = time.perf_counter() - t0, eng.timings
    return dict(ok=ok, errors=errors, output_tokens=out_tokens, makespan_s=wall, out_tok_s=out_tokens / wall,
                engine_steps=t.steps, step_ms=1e3 * wall / max(t.steps, 1), tokens_per_step=t.tokens / max(t.steps, 1),
                gpu_idle_frac=t.gpu_idle / wall, plan_ms=1e3 * t.plan / max(t.steps, 1),
                commit_ms=1e3 * t.commit / max(t.steps, 1), wait_ms=1e3 * t.wait / max(t.steps, 1))


def bench_engine(args, requests) -> list[dict]:
    """One row per --concurrency value (closed loop), mode "engine in-process"."""
    from engine.llm_engine import LLMEngine
    head = dict(target="engine", mode="engine in-process", load="closed")
    try:
        eng = LLMEngine(**engine_config(args))
    except Exception as e:                          # noqa: BLE001 - recorded; the served runs still stand
        note(f"engine: did not start: {e}")
        return [dict(head, error=f"did not start: {e}"[:3000])]
    rows = []
    try:
        by_job = {r["job"]: (eng.apply_chat_template(r["messages"]), params_for(r, args)) for r in requests}
        jobs = list(by_job.values())
        warm = [by_job[r["job"]] for r in warm_set(requests, args.warmup, args.schemas)]
        closed_run(eng, [(ids, _short(p)) for ids, p in warm], min(32, len(warm)))   # graphs, compiles
        for c in args.concurrency:
            note(f"engine in-process: closed {c} ({len(jobs)} requests)")
            rows.append(dict(head, x=c, requests=len(jobs), **closed_run(eng, jobs, c)))
    finally:
        eng.close()
    return rows


def _short(params):
    """The warm-up's version of a request: 8 tokens, its grammar compiled all the same."""
    import dataclasses
    return params if isinstance(params, ValueError) else dataclasses.replace(params, max_tokens=8)
