"""Guided decoding: schema loading, output validation, the quality run and the transformers + xgrammar peer.
`bench/guided/guided.py` drives these (`--only quality`, `--only peer`); see its docstring for the command lines.

Schemas: a directory or a glob of .json files, each either MaskBench's `{description, meta, schema, tests}`
or a bare JSON schema (raw/Glaiveai2K, raw/Github_easy), in natural order (JME_2 before JME_10). Prompt:
"Produce a JSON object that matches this schema: <schema JSON>" through the model's chat template.

Quality, per dataset: all its requests are added at once to one engine (continuous batching, max_num_seqs
--quality-seqs, greedy, compact JSON, --max-tokens). Of the schemas tried (prompts too long for the context
are skipped and counted as `too_long`):
  compiled_frac  share whose guide was accepted: not refused by SamplingParams/add_request (`rejected`) and
                 not ended "error" with "invalid json_schema ..." or "json_schema is valid but the grammar
                 backend ..." (`compile_failed`);
  finished_frac  of the compiled, share that ended "stop" (grammar complete) rather than "length";
  valid_frac     of the finished whose schema `jsonschema` can use, share whose text parses and validates
                 (formats as annotations); valid_fmt_frac: the same with jsonschema's format checker.
                 Schemas jsonschema itself rejects (SchemaError, unresolvable $ref, a pattern Python's `re`
                 cannot compile, ...) are counted as `schema_errors`, not as invalid outputs;
  runtime_errors requests that failed later (a token the grammar rejected, an empty mask, ...).
  compile_ms_*   cold compile time per schema (p50 / p95 / max), one at a time on a grammar service of its own
                 before the run (so the engine's cache stays cold too);
  callback_ms    host time of the grammar node per step; host_us_per_row: per row of a step.
Peer: transformers `generate` (greedy, batch 1) with xgrammar's `contrib.hf.LogitsProcessor`, grammars
compiled by our engine's own GrammarService (same tokenizer info), weights from `engine.source.path`; ours
runs the same requests one at a time (batch 1). tok/s = output tokens / summed wall of the requests
(prefill included), after one untimed request each.
"""
from __future__ import annotations

import time
from collections import Counter

from bench.common import dtype_name, engine_kwargs, engine_overrides, free_gpu_memory, note, progress, record
# the schema sets live in specdec/ (studies use them too); re-exported for the benchmarks that import them here
from specdec.datasets import DATASETS, PROMPT, load_schemas, resolve, schema_prompt  # noqa: F401
from specdec.validate import check_output, explain_output  # noqa: F401


# ---- engine, schemas, prompts ------------------------------------------------------------------------
def build_engine(args, max_num_seqs: int):
    from engine.llm_engine import LLMEngine
    kw = engine_kwargs(args, dtype=args.dtype, depth=args.depth, max_num_seqs=max_num_seqs,
                       enforce_eager=args.enforce_eager)
    return LLMEngine(**(kw | engine_overrides(args)))


def close_engine(eng) -> None:
    """Free what outlives a dropped engine (captured grammar callbacks, compile threads); never raises."""
    try:
        if eng is not None and hasattr(eng, "close"):
            eng.close()
    except Exception as e:                # noqa: BLE001
        note(f"closing the engine failed: {type(e).__name__}: {e}")


def close_engines(engines) -> None:
    """Close each engine, then give their memory back (several engines of one measurement)."""
    for eng in engines:
        close_engine(eng)
    free_gpu_memory()


def dataset_spec(item: str, root: str) -> tuple[str, str]:
    """'NAME' (a known dataset under --data) or 'NAME=PATH' -> (name, path or glob)."""
    name, _, path = item.partition("=")
    if not path and name not in DATASETS:
        raise SystemExit(f"unknown dataset {name!r}: give NAME=PATH or one of {', '.join(DATASETS)}")
    return name, resolve(path or DATASETS[name], root)


def guided_params(schema, max_tokens: int):
    from engine.requests.sequence import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, json_schema=schema)


# ---- validation ---------------------------------------------------------------------------------------
def _frac(a: int, b: int):
    return a / b if b else None


def summarize(items, rejected: int = 0) -> dict:
    """items: (schema, finish_reason, error, text, n_tokens[, name]) per request; `rejected`: refused before
    running. `invalid_cases`: (name, first validation error) of every finished output that fails its schema."""
    c, fmt, examples, invalid_cases = Counter(), 0, {}, []
    for schema, reason, error, text, _, *name in items:
        if reason == "error":
            kind = "compile_failed" if (error or "").startswith(("invalid json_schema", "json_schema is valid but")) \
                else "runtime_errors"
            c[kind] += 1
            examples.setdefault(kind, error)
            continue
        c[reason] += 1
        if reason == "stop":
            status, f, why = explain_output(schema, text)
            c[status] += 1
            fmt += bool(f)
            if why:
                invalid_cases.append([name[0] if name else None, why])
            if status in ("invalid", "unparsable"):
                examples.setdefault(status, text[:200])
    n = len(items) + rejected
    compiled = len(items) - c["compile_failed"]
    checked = c["stop"] - c["schema_error"] - c["unchecked"]
    return dict(compiled_frac=_frac(compiled, n), finished_frac=_frac(c["stop"], compiled),
                valid_frac=_frac(c["valid"], checked), valid_fmt_frac=_frac(fmt, checked),
                valid_of_all=_frac(c["valid"], n), compile_failed=c["compile_failed"], finished=c["stop"],
                length=c["length"], invalid=c["invalid"], unparsable=c["unparsable"],
                schema_errors=c["schema_error"], unchecked=c["unchecked"], runtime_errors=c["runtime_errors"],
                mean_len=_frac(sum(i[4] for i in items), len(items)), examples=examples or None,
                invalid_cases=invalid_cases or None)


# ---- quality ------------------------------------------------------------------------------------------
def compile_times(eng, schemas) -> dict:
    """Cold compile time per schema (ms) on a service of its own (the engine's cache stays cold), one at a time
    on this thread: mean, p50, p95, max; schemas that fail to compile are left out."""
    from engine.guided.compiler import GrammarService
    service, ms = GrammarService(eng.tokenizer, eng.runner.vocab, eng.eos_ids), []
    try:
        for _, schema in schemas:
            try:
                guide = guided_params(schema, 1).guide
                t0 = time.perf_counter()
                service.compile_now(guide)
                ms.append(1e3 * (time.perf_counter() - t0))
            except Exception:             # noqa: BLE001 - counted by the quality run itself
                continue
    finally:
        service.close()
    ms.sort()
    q = lambda f: ms[min(len(ms) - 1, int(f * len(ms)))] if ms else None    # noqa: E731
    return dict(compile_ms_mean=sum(ms) / len(ms) if ms else None, compile_ms_p50=q(0.5), compile_ms_p95=q(0.95),
                compile_ms_max=ms[-1] if ms else None)


def run_quality(eng, name: str, schemas, args) -> dict:
    compile_stats = compile_times(eng, schemas)
    ids, rejected, too_long = {}, 0, 0
    for stem, schema in schemas:
        try:
            params = guided_params(schema, args.max_tokens)
            prompt = schema_prompt(eng, schema)
            if len(prompt) + args.max_tokens > eng.max_model_len:
                too_long += 1
                continue
            ids[eng.add_request(prompt, params, retain=True)] = (schema, stem)
        except (ValueError, TypeError):   # not a JSON object schema, or the request was refused
            rejected += 1
    eng.timings.reset()
    t0 = time.perf_counter()
    bar = iter(progress(range(len(ids)), f"quality {name}"))
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                next(bar, None)
    wall = time.perf_counter() - t0
    for _ in bar:
        pass
    seqs = {rid: eng.take(rid) for rid in ids}
    items = [(ids[r][0], s.finish_reason, s.error, s.text.strip(), len(s.output_token_ids), ids[r][1])
             for r, s in seqs.items()]
    stats = summarize(items, rejected)
    tokens = sum(i[4] for i in items)
    ms = eng.timings.per_step_ms()
    note(f"quality {name}: {len(schemas)} schemas, compiled {stats['compiled_frac']}, finished "
         f"{stats['finished_frac']}, valid {stats['valid_frac']} ({wall:.1f} s)")
    return record("guided", "guided", eng.source.name, dtype_name(eng),
                  eng.config.max_num_seqs, args.max_tokens, tokens / wall, ms["period"], part="quality",
                  dataset=name, schemas=len(schemas), rejected=rejected, too_long=too_long, wall_s=wall,
                  steps=eng.timings.steps, period_ms=ms["period"], callback_ms=ms["callback"],
                  mask_wait_ms=ms["mask_wait_gpu"], gpu_idle_ms=ms["gpu_idle"],
                  host_us_per_row=1e3 * ms["callback"] * eng.timings.steps / max(eng.timings.rows, 1),
                  **compile_stats, **stats)


# ---- peer: transformers generate + xgrammar logits processor, batch 1 ------------------------------------
def hf_guided_generate(eng, max_tokens: int):
    """The peer: transformers generate on the engine's weights, dtype and device, masked by xgrammar's HF
    logits processor, greedy, stopping at the engine's EOS ids. -> (hf(prompt ids, compiled grammar) ->
    (finish reason, None, text, new token ids), a device sync for timing it)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from xgrammar.contrib.hf import LogitsProcessor
    device = eng.runner.device
    model = AutoModelForCausalLM.from_pretrained(str(eng.source.path), dtype=eng.runner.dtype).to(device).eval()
    eos = sorted(eng.eos_ids)
    gcfg = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos[0])

    def hf(prompt, grammar):
        ids = torch.tensor([prompt], device=device)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gcfg,
                                 logits_processor=[LogitsProcessor(grammar)])
        new = out[0, ids.shape[1]:].tolist()
        stop = bool(new) and new[-1] in eng.eos_ids
        text = eng.tokenizer.decode(new[:-1] if stop else new, skip_special_tokens=True)
        return ("stop" if stop else "length"), None, text.strip(), new
    return hf, (torch.cuda.synchronize if device.type == "cuda" else (lambda: None))


def run_peer(eng, schemas, args) -> list[dict]:
    from engine.guided.compiler import GrammarService
    eng.generate([schema_prompt(eng, {"type": "object"})], guided_params({"type": "object"}, 8))  # builds
    service = eng.guided.service or GrammarService(eng.tokenizer, eng.runner.vocab, eng.eos_ids)  # its service
    work = []
    for stem, schema in schemas:
        try:
            params = guided_params(schema, args.max_tokens)
            work.append((schema, schema_prompt(eng, schema), params, service.compile_now(params.guide)))
        except Exception as e:            # noqa: BLE001 - neither side can run it: leave it out of both
            note(f"peer: {stem} left out: {type(e).__name__}: {e}")
    dtype = dtype_name(eng)
    hf, sync = hf_guided_generate(eng, args.max_tokens)

    def ours(prompt, params):
        [seq] = eng.generate([prompt], params)
        return seq.finish_reason, seq.error, seq.text.strip(), list(seq.output_token_ids)

    runners = {"guided": lambda w: ours(w[1], w[2]), "peer-hf": lambda w: hf(w[1], w[3])}
    results = {}
    for mode, fn in runners.items():
        fn(work[0])                                       # untimed: warm-up (JIT, allocator, grammar cache)
        items, wall = [], 0.0
        for w in progress(work, f"peer {mode}"):
            sync()
            t0 = time.perf_counter()
            reason, error, text, toks = fn(w)
            sync()
            wall += time.perf_counter() - t0
            items.append((w[0], reason, error, text, len(toks)))
        results[mode] = (items, wall)
    hf = None
    free_gpu_memory()
    records = []
    for mode, (items, wall) in results.items():
        tokens = sum(i[4] for i in items)
        same = sum(a[3] == b[3] for a, b in zip(results["guided"][0], results["peer-hf"][0]))
        rec = record("guided", mode, eng.source.name, dtype, 1, args.max_tokens,
                     tokens / wall, 1e3 * wall / max(tokens, 1), part="peer", dataset=args.peer_dataset,
                     schemas=len(work), wall_s=wall, same_text_frac=_frac(same, len(work)),
                     **summarize(items))
        note(f"peer {mode}: {rec['tok_s']:,.1f} tok/s, valid {rec['valid_frac']}, finished {rec['finished_frac']}")
        records.append(rec)
    return records
