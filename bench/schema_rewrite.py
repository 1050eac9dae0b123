"""How many JSONSchemaBench schemas guided decoding refuses, before and after the schema rewrite
(engine/guided/schema_rewrite.py), on the CPU, no model needed.

    python bench/schema_rewrite.py [--data ../shared/data/jsonschemabench] [--out bench/results/schema_rewrite]

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
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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
    from engine.guided.spec import grammar_schema
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
    args = p.parse_args(argv)
    results = {fam: family(os.path.join(args.data, g)) for fam, g in FAMILIES.items()}
    text = markdown(results)
    print(text)
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(results, indent=1) + "\n")
        Path(args.out + ".md").write_text("# Schemas refused before / after the schema rewrite\n\n"
                                          "`python bench/schema_rewrite.py --out bench/results/schema_rewrite`\n\n"
                                          + text + "\n")


if __name__ == "__main__":
    main()
