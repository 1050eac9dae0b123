"""How many JSONSchemaBench schemas guided decoding refuses, before and after the schema rewrite
(engine/guided/schema_rewrite.py), on the CPU, no model needed.

    python -m bench.guided.schema_rewrite [--data ../shared/data/jsonschemabench] [--out bench/results/schema_rewrite]

Per family: schemas, refused before (the keyword check on the schema as given), refused after (the rewrite,
then the check: as SamplingParams does), by first reason; changed (the rewrite altered the schema); compile
failures of what is accepted (xgrammar's converter, before: the original, after: the rewritten); and, where
the set has test instances (MaskBench), instances on which `jsonschema` judges original and rewritten schema
differently (must be 0: the rewrite is exact). Writes <out>.json and <out>.md.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from collections import Counter
from pathlib import Path

FAMILIES = {"JME": "maskbench/JME_*.json", "BFCL_simple": "maskbench/BFCL_simple_*.json",
            "BFCL_multiple": "maskbench/BFCL_multiple_*.json", "Glaive": "raw/Glaiveai2K/*.json",
            "Github_easy": "raw/Github_easy/*.json"}


def load(pattern: str):
    import glob
    for f in sorted(glob.glob(pattern)):
        try:
            d = json.loads(Path(f).read_text())
        except ValueError:
            continue
        tests = []
        if isinstance(d, dict) and "schema" in d and "meta" in d:
            d, tests = d["schema"], d.get("tests") or []
        if isinstance(d, dict):
            yield Path(f).stem, d, tests


def reason(message: str) -> str:
    """A refusal's first reason without its path and names, to count them."""
    if "can match nothing" in message:
        return "conflict"
    first = message.split(": ", 1)[1].split("; ")[0]
    return re.sub(r"required .* not in", "required <names> not in", re.sub(r"of \d+ schemas", "of N schemas",
                                                                         first.split(": ", 1)[-1]))


def compiles(schema) -> bool:
    import xgrammar as xgr
    try:
        xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
        return True
    except Exception:           # noqa: BLE001 - any converter error counts
        return False


def disagreements(original, rewritten, tests) -> int:
    import jsonschema
    try:
        a, b = (jsonschema.validators.validator_for(original)(s) for s in (original, rewritten))
        return sum(a.is_valid(t["data"]) != b.is_valid(t["data"]) for t in tests)
    except Exception:           # noqa: BLE001 - a schema jsonschema cannot use is not judged
        return 0


def family(pattern: str) -> dict:
    from engine.guided.schema_check import unenforced_keywords
    from engine.guided.guide import grammar_schema
    c, before, after, took, newly = Counter(), Counter(), Counter(), [], []
    for name, schema, tests in load(pattern):
        c["schemas"] += 1
        old = unenforced_keywords(schema)
        if old:
            before[reason("x: " + old[0])] += 1
        start = time.perf_counter()
        try:
            new = grammar_schema(schema)
        except ValueError as exc:
            after[reason(str(exc))] += 1
            new = None
        took.append(time.perf_counter() - start)
        c["refused_before"] += bool(old)
        c["refused_after"] += new is None
        if new is not None:
            c["changed"] += new != schema
            c["compile_failed_after"] += not compiles(new)
            c["disagreements"] += disagreements(schema, new, tests)
            if old:
                newly.append(name)
        if not old:
            c["compile_failed_before"] += not compiles(schema)
    return {**c, "refused_before_by": dict(before), "refused_after_by": dict(after), "accepted_now": newly,
            "rewrite_ms_p50": 1e3 * statistics.median(took), "rewrite_ms_max": 1e3 * max(took)}


def backends(pattern: str, service) -> dict:
    """Which backend runs each schema (as SamplingParams chooses), whether it compiles there with the model's
    tokenizer, and the compile times per backend."""
    from engine.requests.sequence import SamplingParams
    c, took, refused = Counter(), {"xgrammar": [], "llguidance": []}, Counter()
    for _, schema, _ in load(pattern):
        c["schemas"] += 1
        try:
            guide = SamplingParams(json_schema=schema).guide
        except ValueError as exc:
            c["refused"] += 1
            refused[reason(str(exc).split("; llguidance")[0])] += 1
            continue
        start = time.perf_counter()
        try:
            service.compile_now(guide)
        except Exception:       # noqa: BLE001 - any compile error counts
            c[f"{guide.backend}_compile_failed"] += 1
            continue
        took[guide.backend].append(time.perf_counter() - start)
        c[guide.backend] += 1
    n = c["schemas"]
    out = {**c, "refused_by": dict(refused), "compiled_share": (c["xgrammar"] + c["llguidance"]) / n}
    for backend, times in took.items():
        out[f"{backend}_share"] = c[backend] / n
        if times:
            q = statistics.quantiles(times, n=100) if len(times) > 1 else [times[0]] * 99
            out[f"{backend}_compile_ms_p50"], out[f"{backend}_compile_ms_p99"] = 1e3 * q[49], 1e3 * q[98]
    return out


def backends_markdown(results: dict) -> str:
    rows = ["| family | schemas | xgrammar | llguidance | refused | compile failed | compiled share | "
            "compile p50 / p99 ms xgrammar | llguidance |", "|---|---|---|---|---|---|---|---|---|"]
    for fam, r in results.items():
        failed = r.get("xgrammar_compile_failed", 0) + r.get("llguidance_compile_failed", 0)
        times = [f"{r.get(f'{b}_compile_ms_p50', 0):.1f} / {r.get(f'{b}_compile_ms_p99', 0):.1f}"
                 for b in ("xgrammar", "llguidance")]
        rows.append(f"| {fam} | {r['schemas']} | {r.get('xgrammar', 0)} | {r.get('llguidance', 0)} | "
                    f"{r.get('refused', 0)} | {failed} | {r['compiled_share']:.4f} | {times[0]} | {times[1]} |")
    rows.append("")
    rows += [f"**{fam}** refused: {r['refused_by']}\n" for fam, r in results.items()]
    return "\n".join(rows)


def run_backends(data: str, out: str | None) -> None:
    import platform

    from engine.config import EngineConfig
    from engine.guided.compiler import GrammarService
    from engine.models.loader import load_tokenizer, resolve_model
    config = EngineConfig()
    tok = load_tokenizer(resolve_model(config.tokenizer) if config.tokenizer else resolve_model(config.model))
    service = GrammarService(tok, len(tok), [tok.eos_token_id], threads=1)
    service.llg_tokenizer()     # built once per service, not a compile's cost
    results = {fam: backends(os.path.join(data, g), service) for fam, g in FAMILIES.items()}
    text = backends_markdown(results)
    print(text)
    if out:
        Path(out + ".json").write_text(json.dumps(results, indent=1) + "\n")
        Path(out + ".md").write_text(
            "# JSONSchemaBench: which grammar backend runs each schema\n\n"
            f"`python -m bench.guided.schema_rewrite --backends --out {out}` on {platform.node()} "
            f"({os.cpu_count()} CPUs, {platform.processor() or platform.machine()}), "
            "the default model's tokenizer, one "
            "compile at a time (the machine was shared, so times are upper bounds). A schema is compiled by the "
            "backend SamplingParams picks (auto); refused: neither backend can enforce it.\n\n" + text + "\n")


def markdown(results: dict) -> str:
    rows = ["| family | schemas | refused before | refused after | changed | compile failed before / after | "
            "test instances judged differently |", "|---|---|---|---|---|---|---|"]
    for fam, r in results.items():
        rows.append(f"| {fam} | {r['schemas']} | {r.get('refused_before', 0)} | {r.get('refused_after', 0)} | "
                    f"{r.get('changed', 0)} | {r.get('compile_failed_before', 0)} / {r.get('compile_failed_after', 0)}"
                    f" | {r.get('disagreements', 0)} |")
    rows.append("")
    for fam, r in results.items():
        rows.append(f"**{fam}** refused before: {r['refused_before_by']}; after: {r['refused_after_by']}; "
                    f"rewrite p50 {r['rewrite_ms_p50']:.2f} ms, max {r['rewrite_ms_max']:.1f} ms; "
                    f"accepted now: {', '.join(r['accepted_now']) or '-'}")
        rows.append("")
    return "\n".join(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="../shared/data/jsonschemabench")
    p.add_argument("--out", default=None, help="write <out>.json and <out>.md")
    p.add_argument("--backends", action="store_true", help="count the schemas each grammar backend compiles "
                   "(the model's tokenizer), refused ones, and compile times per backend")
    args = p.parse_args(argv)
    if args.backends:
        run_backends(args.data, args.out)
        return
    results = {fam: family(os.path.join(args.data, g)) for fam, g in FAMILIES.items()}
    text = markdown(results)
    print(text)
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(results, indent=1) + "\n")
        Path(args.out + ".md").write_text("# Schemas refused before / after the schema rewrite\n\n"
                                          "`python -m bench.guided.schema_rewrite --out "
                                          "bench/results/schema_rewrite`\n\n" + text + "\n")


if __name__ == "__main__":
    main()
