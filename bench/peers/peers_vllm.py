"""Our engine beside vLLM on one GPU: the same checkpoint directory, prompts and lengths, greedy decoding.

    python -m bench.peers.peers_vllm                            # both sides, 1/8/32/64 streams, bf16
    python -m bench.peers.peers_vllm --sides vllm --parts decode --streams 1 8 --out /root/pv/peers_vllm.json
    python -m bench.peers.peers_vllm --dry-run                  # print the plan (any machine, imports nothing)

Setup on the GPU machine (vLLM 0.26.0 staged into /root/vllm-site by bench/peers/stage_vllm.py): docs/peers.md.

The driver resolves the checkpoint (engine.models.loader: the default GGUF, converted once to a bf16-loadable
HF directory) and builds the work; each side then runs in its own process (bench/peers/sides.py: its own CUDA
context, all memory back before the next side), ours in this environment, vLLM's with PYTHONPATH=--vllm-site
alone. Each side builds one engine (max_num_seqs = the largest --streams) and runs, per streams value N:
  decode  N chat prompts (bench.common.chat_prompts, as bench/step/throughput.py), ignore_eos, --new-tokens each;
          after a warm-up (other prompts, 8 tokens), --repeats runs of 1 token (ttft_ms: the batch's prefill)
          and of --new-tokens (medians). tok_s = N x new_tokens / wall, ms_per_step = wall / new_tokens,
          tpot_ms = (wall - ttft) / (new_tokens - 1): each stream's per-token decode latency.
  guided  request k asks for JSON schema k % S of --schemas (the first --schema-limit of JSON Mode Eval) with
          bench/guided/guided_quality.py's prompt, --guided-tokens cap, EOS allowed; one untimed round compiles every
          grammar. Ours: SamplingParams(json_schema=...), compact JSON; vLLM: StructuredOutputsParams(json=...),
          backend xgrammar, disable_any_whitespace: both compile the same xgrammar 0.2.8 grammar.
  free    the guided prompts without a guide, ignore_eos, request k's max_tokens = its guided length:
          guided_over_free = guided wall / free wall (the cost of the masks on that engine).
  jme     the guided prompts without a guide, EOS allowed, the same cap (the baseline of `ngram`).
  ngram   (an engine of its own, built with the drafter) n-gram speculation at --spec-k drafts, n in --ngram-n
          (ours: ngram drafter; vLLM: its `ngram` method with prompt_lookup_min/max): `ngram` = jme's work,
          `ngram_guided` = guided's. accept_len = 1 + accepted drafts / row-steps that verified a draft (vLLM's
          definition, from its spec_decode counters; ours from the requests' per-position counts);
          spec_speedup = tok_s / the same engine's tok_s without it; same_as_plain = share of outputs equal to
          that run's (greedy speculation is lossless). Ours does not speculate in steps of more than
          spec_max_batch rows (32) nor while acceptance is below spec_min_acceptance; vLLM always drafts.
Matched settings: bf16; max_num_batched_tokens 2048 (our default); memory fraction 0.5 (ours: KV cache share,
vLLM: gpu_memory_utilization); no prefix caching (ours has none); CUDA graphs (vLLM: its default torch.compile
with FULL_AND_PIECEWISE graphs). Cross-checks: same_tokens (decode: mean shared greedy prefix / new_tokens) and
same_text (other modes: share of identical outputs); over_vllm = our tok_s / vLLM's, on our rows (the checks and
the report: bench/peers/vllm_report.py).
Writes --out (JSON), a .md, a .png (tok_s by streams, a panel per mode) and .outputs.json (the token ids)
beside it, after each side; prints the markdown last. --merge keeps the rows of (side, mode) pairs not run
now, so one side's parts can run per command (each within a 10-minute device call).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO, chat_prompts, command_line, note, record, write_results
from bench.guided.guided_quality import PROMPT, load_schemas, resolve
from bench.peers.vllm_report import MODES, PARTS, SIDES, cross_check, plot_modes, write_markdown

WORKER = ("-m", "bench.peers.sides")   # a side's process: python WORKER PLAN RESULT, from the repository
EXIT_GRACE = 60                           # s a side may take to exit once its result is written


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model spec for engine.models.loader (default: the default model)")
    p.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--guided-tokens", type=int, default=256, help="guided: max_tokens cap")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per case (the median is kept)")
    p.add_argument("--spec-k", type=int, default=3, help="ngram: drafts per step (K)")
    p.add_argument("--ngram-n", type=int, nargs=2, default=[1, 3], metavar=("MIN", "MAX"),
                   help="ngram: the n-gram lengths matched (ours: ngram_min_n/max_n; vLLM: prompt_lookup_min/max)")
    p.add_argument("--data", default=os.environ.get("SPECDEC_VLLM_DATA", "tests/data"),
                   help="root of the schema sets ($SPECDEC_VLLM_DATA on the GPU machine)")
    p.add_argument("--schemas", default="maskbench/JME_*.json", help="guided: schema files (under --data)")
    p.add_argument("--schema-limit", type=int, default=32, help="guided: the first N schemas")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--memory-fraction", type=float, default=0.5)
    p.add_argument("--enforce-eager", action="store_true", help="both sides without CUDA graphs")
    p.add_argument("--vllm-prefix-caching", action="store_true", help="let vLLM cache prefixes (ours has none)")
    p.add_argument("--engine", type=json.loads, default={}, metavar="JSON", help="extra EngineConfig fields")
    p.add_argument("--vllm-args", type=json.loads, default={}, metavar="JSON", help="extra vllm.LLM arguments")
    p.add_argument("--vllm-site", default=os.environ.get("SPECDEC_VLLM_SITE", "/root/vllm-site"))
    p.add_argument("--vllm-log-level", default="WARNING")
    p.add_argument("--side-timeout", type=int, default=480, help="seconds one side may take")
    p.add_argument("--out", default="bench/results/peers_vllm.json")
    p.add_argument("--merge", action="store_true", help="keep the other sides' rows (and outputs) of an earlier "
                   "run into --out: one side per command, cross-checked once both ran")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    return p.parse_args(argv)


# ---- plan -------------------------------------------------------------------------------------------------
def settings(args) -> dict:
    return dict(max_num_batched_tokens=args.max_num_batched_tokens, memory_fraction=args.memory_fraction,
                enforce_eager=args.enforce_eager, vllm_prefix_caching=args.vllm_prefix_caching,
                engine=args.engine, vllm=args.vllm_args)


def side_env(side: str, args) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if side == "vllm":                    # vLLM's wheels alone: not the engine's /root/site (other versions)
        env.update(PYTHONPATH=args.vllm_site, VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1",
                   VLLM_USE_FLASHINFER_SAMPLER="0",     # not staged: its sampler would import it to ask
                   TRANSFORMERS_OFFLINE="1", VLLM_LOGGING_LEVEL=args.vllm_log_level)
    return env


def chat_ids(tok, text: str) -> list[int]:
    out = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return [int(t) for t in (out["input_ids"] if hasattr(out, "keys") else out)]


# What vLLM 0.26's xgrammar backend refuses before compiling (it answers "features not supported by xgrammar"),
# read off its source: such a schema fails the whole batch it is in, so neither side runs it.
XGRAMMAR_FORMATS = {"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
                    "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"}


def vllm_refuses(node) -> bool:
    if isinstance(node, list):
        return any(vllm_refuses(x) for x in node)
    if not isinstance(node, dict):
        return False
    kind = node.get("type")
    if (kind in ("integer", "number") and "multipleOf" in node
            or kind == "array" and {"uniqueItems", "contains", "minContains", "maxContains"} & node.keys()
            or kind == "string" and "format" in node and node["format"] not in XGRAMMAR_FORMATS
            or kind == "object" and {"patternProperties", "propertyNames"} & node.keys()):
        return True
    return any(vllm_refuses(v) for v in node.values() if isinstance(v, (dict, list)))


def build_plan(args) -> dict:
    from engine.models.loader import load_tokenizer, resolve_model
    from engine.requests.sequence import SamplingParams
    src = resolve_model(args.model)
    if src.path is None:
        raise SystemExit(f"{src.name} has no checkpoint directory (dummy weights): vLLM needs one")
    tok = load_tokenizer(src)
    guided = []
    skipped = []
    if {"guided", "ngram"} & set(args.parts):
        for name, schema in load_schemas(resolve(args.schemas, args.data), args.schema_limit):
            # ours refuses what xgrammar cannot enforce (on a GPU; both sides run xgrammar): both skip it
            try:
                SamplingParams(json_schema=schema, guided_backend="xgrammar")
            except ValueError as e:
                skipped.append(f"{name}: ours: {e}")
                continue
            if vllm_refuses(schema):
                skipped.append(f"{name}: vLLM's xgrammar backend refuses it (its pre-check of keywords)")
                continue
            guided.append(dict(schema=schema, prompt=chat_ids(tok, PROMPT.format(json.dumps(schema)))))
        for line in skipped:
            note(f"schema left out: {line}")
    eos = src.config.get("eos_token_id")
    eos_ids = {*(eos if isinstance(eos, list) else [eos]), tok.eos_token_id} - {None}
    return dict(model_dir=str(src.path), model_name=src.name, eos_ids=sorted(eos_ids), dtype=args.dtype,
                streams=args.streams, parts=args.parts, modes=MODES, new_tokens=args.new_tokens,
                spec=dict(k=args.spec_k, min_n=args.ngram_n[0], max_n=args.ngram_n[1]),
                guided_tokens=args.guided_tokens, repeats=args.repeats, guided=guided, skipped_schemas=skipped,
                settings=settings(args),
                prompts=chat_prompts(tok, 2 * max(args.streams)))       # timed: [:N], warm-up: [-N:]


def dry_run(args) -> None:
    schemas = sorted(glob.glob(resolve(args.schemas, args.data)))[:args.schema_limit]
    print(f"model: {args.model or os.environ.get('SPECDEC_MODEL') or 'default'} (converted HF directory), {args.dtype}")
    print(f"streams {args.streams}; decode {args.new_tokens} tokens; guided cap {args.guided_tokens}; "
          f"{args.repeats} repeats; parts {args.parts}")
    print(f"schemas: {len(schemas)} files from {resolve(args.schemas, args.data)}")
    print(f"settings: {json.dumps(settings(args))}")
    for side in args.sides:
        path = side_env(side, args).get("PYTHONPATH", "")
        print(f"side {side}: {sys.executable} {' '.join(WORKER)} PLAN RESULT  (PYTHONPATH={path!r}, "
              f"timeout {args.side_timeout} s)")
    if "vllm" in args.sides and not Path(args.vllm_site).is_dir():
        print(f"note: {args.vllm_site} does not exist here: stage it (docs/peers.md)")
    print(f"out: {args.out} (+ .md, .png)")


# ---- sides ------------------------------------------------------------------------------------------------
def groups(parts: list[str]) -> list[list[str]]:
    """Parts that share one engine: everything but n-gram, then n-gram (an engine built with its drafter)."""
    return [g for g in ([p for p in parts if p != "ngram"], [p for p in parts if p == "ngram"]) if g]


def run_side(side: str, plan: dict, args, tmp: Path) -> dict:
    """The side's process, in its own session: ended with its children (vLLM's engine core) on a timeout or
    when it has not exited EXIT_GRACE s after writing its result."""
    tag = f"{side}_{'_'.join(plan['parts'])}"
    plan_path, result_path = tmp / f"plan_{tag}.json", tmp / f"result_{tag}.json"
    plan = dict(plan, side=side, spec=plan["spec"] if "ngram" in plan["parts"] else None)
    plan_path.write_text(json.dumps(plan))
    note(f"{side}: starting its process for {plan['parts']}")
    proc = subprocess.Popen([sys.executable, *WORKER, str(plan_path), str(result_path)], cwd=REPO,
                            env=side_env(side, args), start_new_session=True)
    start, done = time.monotonic(), None
    while proc.poll() is None:
        now = time.monotonic()
        done = done or (now if result_path.exists() else None)
        if now - start > args.side_timeout or (done and now - done > EXIT_GRACE):
            note(f"{side}: ending its process ({'timed out' if not done else 'slow to exit'})")
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        time.sleep(0.5)
    if result_path.exists():
        return json.loads(result_path.read_text())
    return dict(records=[], outputs={}, error=f"the {side} process ended ({proc.returncode}) without a result "
                f"after {time.monotonic() - start:.0f} s (its output is above)")


def failed_rows(side: str, plan: dict, error: str) -> list[dict]:
    return [record("peers_vllm", mode, plan["model_name"], plan["dtype"], n, plan["new_tokens"], None, None,
                   side=side, label=f"{side} {mode}", error=error)
            for n in plan["streams"] for part in plan["parts"] for mode in MODES[part]]


# ---- output -----------------------------------------------------------------------------------------------


def earlier(args) -> tuple[list[dict], dict]:
    """--merge: the rows and outputs of (side, mode) pairs not run now, from an earlier run into the same --out."""
    out, stem = Path(args.out), args.out.rsplit(".", 1)[0]
    if not args.merge or not out.exists():
        return [], {}
    now = {(side, m) for side in args.sides for part in args.parts for m in MODES[part]}
    rows = [r for r in json.loads(out.read_text()) if (r.get("side"), r.get("mode")) not in now]
    path = Path(stem + ".outputs.json")
    old = json.loads(path.read_text()) if path.exists() else {}
    outputs = {side: {m: v for m, v in modes.items() if (side, m) not in now} for side, modes in old.items()}
    note(f"--merge: kept {len(rows)} rows of {sorted({(r['side'], r['mode']) for r in rows})} from {out}")
    return rows, outputs


def write_all(records: list[dict], outputs: dict, plan: dict, args) -> None:
    """JSON, PNG and markdown of what has run so far (after each side: a later hang keeps the earlier one)."""
    cross_check(records, outputs, plan)
    out = Path(args.out)
    write_results(records, out)
    stem = str(out).rsplit(".", 1)[0]
    Path(stem + ".outputs.json").write_text(json.dumps(outputs))      # token ids: for a later --merge
    plot_modes(records, Path(stem + ".png"), f"specdec vs vLLM ({plan['model_name']}, {args.dtype}, greedy)")
    return write_markdown(records, Path(stem + ".md"))


def main(argv=None):
    args = parse_args(argv)
    if args.dry_run:
        return dry_run(args)
    plan = build_plan(args)
    (records, outputs), text = earlier(args), ""
    with tempfile.TemporaryDirectory(prefix="peers_vllm_") as tmp:
        for side in args.sides:
            for parts in groups(args.parts):
                part_plan = dict(plan, parts=parts)
                res = run_side(side, part_plan, args, Path(tmp))
                rows = res["records"] or failed_rows(side, part_plan, res["error"] or "no records")
                for r in rows:
                    r["command"] = command_line()          # the driver's, not the side process's
                records += rows
                outputs.setdefault(side, {}).update(res.get("outputs") or {})
                text = write_all(records, outputs, plan, args)
    print(text)
    return records


if __name__ == "__main__":
    main()
