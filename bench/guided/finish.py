"""Guided outputs at a token budget: how many end valid with closing on and off (docs/guided.md, "Outputs that
always finish").

    python -m bench.guided.finish --datasets JME BFCL --max-tokens 128 512 --out bench/results/guided_finish

For each dataset and max_tokens, every schema's request (greedy, compact JSON, the prompt "Produce a JSON object
that matches this schema: ...") runs once with `close_at_budget` and `repetition_guard` on and once with both off,
all requests of a run added to one engine at once. Per run:
  valid_frac     outputs that parse and validate against their schema (jsonschema), of the requests that ran;
  required_frac  outputs whose top level holds every required property, of the same;
  stop / length / error   finish reasons (error: a budget no output fits, or a schema the engine refuses);
  closed_budget / closed_repetition   outputs the engine closed, by cause; tokens_mean: output tokens.
Writes finish.json, finish.md and finish.png (valid_frac by run) under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from bench.common import bars, command_line, device_name, engine_kwargs, markdown_table, note
from specdec.datasets import DATASETS, load_schemas, resolve, schema_prompt
from specdec.validate import check_output

COLUMNS = ["dataset", "max_tokens", "closing", "requests", "valid_frac", "required_frac", "stop", "length", "error",
           "closed_budget", "closed_repetition", "tokens_mean", "wall_s"]


def required_present(schema, text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    need = schema.get("required", []) if isinstance(schema, dict) else []
    return isinstance(value, dict) and all(k in value for k in need) if need else isinstance(value, (dict, list))


def run(eng, schemas, max_tokens: int, closing: bool) -> dict:
    from engine.requests.sequence import SamplingParams
    prompts, params, kept = [], [], []
    for name, schema in schemas:
        try:
            params.append(SamplingParams(max_tokens=max_tokens, temperature=0, json_schema=schema,
                                         close_at_budget=closing, repetition_guard=closing))
        except ValueError:
            continue                    # a schema the engine refuses up front: not a guided output
        prompts.append(schema_prompt(eng, schema))
        kept.append((name, schema))
    t0 = time.perf_counter()
    seqs = eng.generate(prompts, params)
    wall = time.perf_counter() - t0
    ran = [(s, seq) for (_, s), seq in zip(kept, seqs) if seq.finish_reason != "error"]
    valid = sum(check_output(s, seq.text)[0] == "valid" for s, seq in ran)
    required = sum(required_present(s, seq.text) for s, seq in ran)
    reasons = [seq.finish_reason for seq in seqs]
    return dict(max_tokens=max_tokens, closing="on" if closing else "off", requests=len(seqs),
                valid_frac=round(valid / max(len(ran), 1), 3), required_frac=round(required / max(len(ran), 1), 3),
                stop=reasons.count("stop"), length=reasons.count("length"), error=reasons.count("error"),
                closed_budget=sum(seq.closed_by == "budget" for seq in seqs),
                closed_repetition=sum(seq.closed_by == "repetition" for seq in seqs),
                tokens_mean=round(sum(len(seq.output_token_ids) for _, seq in ran) / max(len(ran), 1), 1),
                wall_s=round(wall, 1))


def write(out: Path, meta: dict, records: list[dict]) -> str:
    """finish.json and finish.md as they stand (after every run: a cut sweep keeps what it measured)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "finish.json").write_text(json.dumps(dict(meta, records=records), indent=1) + "\n")
    table = markdown_table(records, COLUMNS)
    (out / "finish.md").write_text(f"Command: `{meta['command']}` on {meta['device']}, {meta['dtype']}, "
                                   f"{meta['model']}\n\n{table}\n")
    return table


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=os.environ.get("SPECDEC_MODEL") or None)
    p.add_argument("--tokenizer", default=None, help="a dummy model's tokenizer (default: the model's own)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    p.add_argument("--datasets", nargs="+", default=["JME", "BFCL"], choices=["JME", "BFCL"])
    p.add_argument("--data", default=os.environ.get("SPECDEC_DATA", "../shared/data") + "/jsonschemabench")
    p.add_argument("--limit", type=int, default=None, help="schemas per dataset (default: all)")
    p.add_argument("--max-tokens", type=int, nargs="+", default=[128, 512])
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--out", default="bench/results/guided_finish")
    args = p.parse_args(argv)
    from engine.llm_engine import LLMEngine
    cpu = args.device == "cpu" or (args.device == "auto" and not __import__("torch").cuda.is_available())
    dtype = args.dtype or ("float32" if cpu else "bfloat16")
    extra = dict(tokenizer=args.tokenizer) if args.tokenizer else {}
    eng = LLMEngine(**engine_kwargs(args, dtype=dtype, max_num_seqs=args.max_num_seqs,
                                    max_model_len=max(args.max_tokens) + 2048, **extra))
    out, records = Path(args.out), []
    meta = dict(command=command_line(), device=device_name(), dtype=dtype, model=str(eng.config.model))
    for dataset in args.datasets:
        schemas = load_schemas(resolve(DATASETS[dataset], args.data), limit=args.limit)
        for max_tokens in args.max_tokens:
            for closing in (False, True):
                rec = dict(dataset=dataset, **run(eng, schemas, max_tokens, closing))
                note(f"{dataset} max_tokens={max_tokens} closing {rec['closing']}: valid {rec['valid_frac']}, "
                     f"stop/length/error {rec['stop']}/{rec['length']}/{rec['error']} ({rec['wall_s']} s)")
                records.append(rec)
                table = write(out, meta, records)
    bars([dict(r, run=f"{r['max_tokens']} {r['closing']}") for r in records], "dataset", "run",
         ["valid_frac", "required_frac"], out / "finish.png", "guided outputs at a token budget: closing off and on")
    print(table)


if __name__ == "__main__":
    main()
