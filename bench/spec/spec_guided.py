"""Guided + speculative decoding: acceptance length on JSON schemas per drafting mode (the TensorRT-LLM guided +
speculative article's Table 1),
batch-1 latency of a complete valid tool call against our guided engine without speculation and against
transformers generate + xgrammar, and step time / compute-stream idle at 1 / 8 / 32 streams.

    python -m bench.spec.spec_guided --only acceptance --datasets JME BFCL     # all schemas of each set
    python -m bench.spec.spec_guided --only latency --limit 20
    python -m bench.spec.spec_guided --only latency --limit 20 --warm-grammars   # schemas compiled before timing
    python -m bench.spec.spec_guided --only streams --streams 1 8 32
    python -m bench.spec.spec_guided --device cpu --dtype float32 --limit 2 --max-tokens 24 --streams 1 \\
        --out /tmp/sg.json                                                      # smoke

Modes (K = --k, greedy, every request guided by its schema): none (guided, no speculation); head (the EAGLE
head, drafts cut by the grammar's walk before verification); head+masks (each draft step picks under its own
grammar mask: K host callbacks per step); head+masks+forced and head+forced (grammar-forced drafts, with and
without draft masks); head+tree and head+masks+tree (draft trees); ngram (cut by the grammar).
- acceptance: specdec.acceptance's study (docs/acceptance.md), one engine per mode, --batch rows, every step
  speculating (spec_min_acceptance 0), eager (the tokens are the graphs'); acceptance_length = tokens per
  verifying row-step (K + 1 at most); forced_per_step = forced drafts proposed per verifying row-step;
  valid_frac over outputs ending "stop".
- latency: engines of every mode side by side (CUDA graphs, depth 2), one request at a time, the modes
  alternating per schema, then the peer on the same schemas; ms_per_call = mean wall per request (its
  complete tool call), speedup = tok_s over "none". Each engine compiles a schema on its first call, inside the
  timing; --warm-grammars compiles them all before it, as a server that has seen those tools does.
- streams: per stream count, 4 x streams requests through each mode (CUDA graphs); ms_per_step, idle_frac
  (compute stream idle between steps / wall), target callback and draft callback host ms per step.
head+tree and head+masks+tree verify draft trees of --tree drafts (spec_tree), K of them the chain. Records carry
guided, draft_mask and forced_drafts booleans and spec_tree beside bench/spec/spec.py's keys.
"""
from __future__ import annotations

import argparse
import os
import time

from bench.common import engine_kwargs, markdown_table, note, plot, record, write_results
from bench.guided.guided_quality import (DATASETS, check_output, close_engines, guided_params, hf_guided_generate,
                                         load_schemas, resolve, schema_prompt)
from specdec.acceptance.measure import draft_masks, forced_per_step

MODES = {"none": {},
         "head": dict(speculative="eagle", guided_draft_masks=False, guided_forced_drafts=False),
         "head+masks": dict(speculative="eagle", guided_draft_masks=True, guided_forced_drafts=False),
         "head+masks+forced": dict(speculative="eagle", guided_draft_masks=True, guided_forced_drafts=True),
         "head+forced": dict(speculative="eagle", guided_draft_masks=False, guided_forced_drafts=True),
         "head+tree": dict(speculative="eagle", guided_draft_masks=False, guided_forced_drafts=False),
         "head+masks+tree": dict(speculative="eagle", guided_draft_masks=True, guided_forced_drafts=False),
         "ngram": dict(speculative="ngram")}
COLUMNS = {"acceptance": ["mode", "dataset", "pass", "prompts", "acceptance_length", "forced_per_step", "valid_frac",
                          "finished_frac", "tok_s"],
           "latency": ["mode", "calls", "ms_per_call", "tok_s", "speedup", "acceptance_length", "valid_frac"],
           "streams": ["streams", "mode", "tok_s", "speedup", "ms_per_step", "idle_frac", "callback_ms",
                       "draft_callback_ms", "mask_wait_ms", "acceptance_length"]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=list(COLUMNS), default=list(COLUMNS))
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--data", default=os.environ.get("SPECDEC_DATA", "../shared/data") + "/jsonschemabench")
    p.add_argument("--datasets", nargs="+", default=["JME", "BFCL"])
    p.add_argument("--limit", type=int, default=None, help="schemas per dataset (acceptance), calls (latency)")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--tree", type=int, default=16, help="the +tree modes' draft trees: N drafts, K of them the chain "
                                                        "(spec_tree)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--no-peer", action="store_true")
    p.add_argument("--warm-grammars", action="store_true",
                   help="latency: compile every schema in each engine before the timed calls, as a server that has "
                        "served those tools before holds them in its grammar cache")
    p.add_argument("--passes", type=int, default=1,
                   help="acceptance: runs of each dataset on the same engine (records carry `pass`), the later ones "
                        "as a server that met those schemas before runs them")
    p.add_argument("--out", default="bench/results/spec_guided.json")
    return p.parse_args(argv)


def build(args, mode: str, rows: int, eager: bool):
    from engine.llm_engine import LLMEngine
    kw = engine_kwargs(args, dtype=args.dtype, max_num_seqs=rows, enforce_eager=eager, spec_min_acceptance=0.0,
                       spec_max_batch=rows, num_speculative_tokens=args.k, **limits(rows))
    return LLMEngine(**(kw | MODES[mode] | tree(args, mode)))


def workload(eng, args, dataset: str, limit):
    """(schema, prompt, params) of the schemas that compile."""
    from engine.guided.compiler import GrammarService
    service, out = GrammarService(eng.tokenizer, eng.runner.vocab, eng.eos_ids), []
    for _, schema in load_schemas(resolve(DATASETS[dataset], args.data), limit):
        try:
            params = guided_params(schema, args.max_tokens)
            service.compile_now(params.guide)
            out.append((schema, schema_prompt(eng, schema), params))
        except Exception:                   # noqa: BLE001 - refused or not compiled: left out of every mode
            continue
    service.close()
    return out


def tree(args, mode: str) -> dict:
    """A +tree mode's spec_tree."""
    return dict(spec_tree=args.tree) if mode.endswith("+tree") else {}


def flags(args, mode: str) -> dict:
    m = MODES[mode]
    return dict(guided=True, drafter=m.get("speculative", "none"), draft_mask=m.get("guided_draft_masks", False),
                forced_drafts=m.get("guided_forced_drafts", False) and m.get("speculative") == "eagle",
                spec_tree=tree(args, mode).get("spec_tree", 0))


def outcome(work, seqs) -> dict:
    stopped = [check_output(w[0], s.text)[0] for w, s in zip(work, seqs) if s.finish_reason == "stop"]
    checked = [v for v in stopped if v != "unchecked"]      # (unchecked: no jsonschema where the bench ran)
    return dict(valid_frac=round(sum(v == "valid" for v in checked) / len(checked), 4) if checked else None,
                finished_frac=round(len(stopped) / len(seqs), 4), errors=sum(s.error is not None for s in seqs))


def limits(rows: int) -> dict:
    """Every mode's context and KV pages (1,024 tokens of pages per row)."""
    return dict(num_kv_blocks=max(rows, 8) * 1024 // 16, max_model_len=2048)


def draft_stats(eng) -> dict:
    d, t = draft_masks(eng), eng.timings
    return dict(forced_per_step=forced_per_step(eng),
                draft_callback_ms=round(1e3 * d.callback_s / max(t.steps, 1), 4) if d else 0.0,
                acceptance_length=round(t.acceptance_length, 4) if t.spec_rows else None)


def reset(eng) -> None:
    eng.timings.reset()
    d = draft_masks(eng)
    if d is not None:
        d.forced_drafts, d.callback_s = 0, 0.0


def run_acceptance(args) -> list[dict]:
    """specdec.acceptance's study, one per mode (guided, greedy, eager, no "none" engine), in this bench's records."""
    from specdec.acceptance import Study, run_study
    records = []
    for mode in [m for m in args.modes if m != "none"]:
        m = MODES[mode]
        study = Study(datasets=args.datasets, drafters=[m["speculative"]], ks=[args.k], guided=[True],
                      draft_masks=[m.get("guided_draft_masks", False)],
                      forced_drafts=[m.get("guided_forced_drafts", False)],
                      batch=args.batch, max_tokens=args.max_tokens, prompts=args.limit or 10 ** 6, device=args.device,
                      dtype=args.dtype, data=args.data, baseline=False, passes=args.passes,
                      engine=dict(enforce_eager=True, **limits(args.batch), **tree(args, mode)))
        for r in run_study(study, progress=False):
            rec = record("spec_guided_acceptance", mode, r["model"], args.dtype, args.batch, r["new_tokens"],
                         r["tok_s"],
                         r["ms_per_step"], dataset=r["dataset"], prompts=r["prompts"], k=args.k, **flags(args, mode),
                         **{key: r[key] for key in ("forced_per_step", "acceptance_length", "valid_frac",
                                                    "finished_frac", "errors", "pass") if key in r})
            records.append(rec)
            run = f" pass {r['pass']}" if "pass" in r else ""
            note(f"acceptance {mode} {r['dataset']}{run}: {rec['acceptance_length']} (forced/step "
                 f"{rec['forced_per_step']})")
    return records


def run_latency(args) -> list[dict]:
    modes = args.modes
    engines = {m: build(args, m, 1, eager=False) for m in modes}
    work = workload(engines[modes[0]], args, args.datasets[0], args.limit or 20)
    runs = {m: [] for m in modes}
    try:
        for eng in engines.values():                            # warm-up: kernels, grammar cache
            eng.generate([work[0][1]], [work[0][2]])
            if args.warm_grammars:
                warm_grammars(eng, work)
            reset(eng)
        for i, w in enumerate(work):
            for m in modes[i % len(modes):] + modes[:i % len(modes)]:
                t0 = time.perf_counter()
                [seq] = engines[m].generate([w[1]], [w[2]])
                runs[m].append((time.perf_counter() - t0, seq))
        records = [latency_record(args, engines[m], m, work, runs[m]) for m in modes]
        if not args.no_peer:
            records.append(peer_latency(args, engines[modes[0]], work))
    finally:
        close_engines(engines.values())
    add_speedup(records)
    return records


def warm_grammars(eng, work) -> None:
    """Every schema's grammar into `eng`'s cache, one compile at a time (the timed calls then hit it)."""
    eng.guided.ensure_service()
    for w in work:
        eng.guided.service.submit(w[2].guide).future.result()


def latency_record(args, eng, mode, work, runs) -> dict:
    wall = sum(t for t, _ in runs)
    seqs = [s for _, s in runs]
    tokens = sum(len(s.output_token_ids) for s in seqs)
    return record("spec_guided_latency", mode, eng.source.name, args.dtype, 1, tokens, tokens / wall,
                  1e3 * wall / max(eng.timings.steps, 1), calls=len(runs), k=args.k,
                  ms_per_call=round(1e3 * wall / len(runs), 2), warm_grammars=args.warm_grammars,
                  **flags(args, mode), **draft_stats(eng),
                  **outcome(work, seqs))


def peer_latency(args, eng, work) -> dict:
    """transformers generate + xgrammar (guided_quality.hf_guided_generate) on `eng`'s weights, each call
    compiling its grammar as an engine's first request of a schema does."""
    from engine.guided.compiler import GrammarService
    service = GrammarService(eng.tokenizer, eng.runner.vocab, eng.eos_ids)
    hf, sync = hf_guided_generate(eng, args.max_tokens)

    def call(w):
        return hf(w[1], service.compile_now(w[2].guide))

    call(work[0])
    wall, tokens, seqs = 0.0, 0, []
    for w in work:
        sync()
        t0 = time.perf_counter()
        reason, _, text, new = call(w)
        sync()
        wall += time.perf_counter() - t0
        tokens += len(new)
        seqs.append(type("Out", (), dict(text=text, finish_reason=reason, error=None)))
    service.close()
    return record("spec_guided_latency", "peer-hf", eng.source.name, args.dtype, 1, tokens, tokens / wall,
                  1e3 * wall / max(tokens, 1), calls=len(work), ms_per_call=round(1e3 * wall / len(work), 2),
                  guided=True, drafter="none", draft_mask=False, forced_drafts=False, **outcome(work, seqs))


def add_speedup(records: list[dict]) -> None:
    """speedup = tok_s over the "none" record of the same list (None without one)."""
    base = next((r["tok_s"] for r in records if r["mode"] == "none"), None)
    for r in records:
        r["speedup"] = round(r["tok_s"] / base, 3) if base else None


def run_streams(args) -> list[dict]:
    records = []
    for streams in args.streams:
        engines = {m: build(args, m, streams, eager=False) for m in args.modes}
        try:
            work = workload(engines[args.modes[0]], args, args.datasets[0], max(4 * streams, 16))
            prompts, params = [w[1] for w in work], [w[2] for w in work]
            found = {}
            for m, eng in engines.items():
                eng.generate(prompts[:2], params[:2])           # warm-up
                reset(eng)
                t0 = time.perf_counter()
                seqs = eng.generate(prompts, params)
                wall = time.perf_counter() - t0
                t, tokens = eng.timings, sum(len(s.output_token_ids) for s in seqs)
                n = max(t.steps, 1)
                found[m] = record("spec_guided_streams", m, eng.source.name, args.dtype, streams, tokens, tokens / wall,
                                  1e3 * t.wall / n, k=args.k, idle_frac=round(t.gpu_idle / max(t.wall, 1e-9), 4),
                                  callback_ms=round(1e3 * t.callback / n, 4),
                                  mask_wait_ms=round(1e3 * t.mask_wait_gpu / n, 4),
                                  **flags(args, m), **draft_stats(eng), **outcome(work, seqs))
            add_speedup(list(found.values()))
            for r in found.values():
                records.append(r)
                note(f"streams={streams} {r['mode']}: {r['tok_s']:.0f} tok/s x{r['speedup']} idle {r['idle_frac']}")
        finally:
            close_engines(engines.values())
    return records


def main(argv=None):
    args = parse_args(argv)
    parts = {"acceptance": run_acceptance, "latency": run_latency, "streams": run_streams}
    records = [r for part in args.only for r in parts[part](args)]
    out = write_results(records, args.out)
    md = [f"Command: `{records[0]['command']}` on {records[0]['device']}, commit {records[0]['git_commit']}."
          if records else "", ""]
    for part in args.only:
        rows = [r for r in records if r["bench"] == f"spec_guided_{part}"]
        md += [f"### {part}", "", markdown_table(rows, COLUMNS[part]), ""]
    streams = [r for r in records if r["bench"] == "spec_guided_streams"]
    if streams:
        plot(streams, "streams", "tok_s", "mode", out.with_suffix(".png"), "guided tokens/s by streams (K = 3)")
    text = "\n".join(md)
    out.with_suffix(".md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
