"""OpenAI-compatible serving under load: `specdec serve` (ours) and `transformers serve` (the peer, continuous
batching) on the same weights, in one run, each started as a subprocess and stopped after its runs.

    python -m bench.serving.serve                              # both, 8/32/128 req/s + 1/8/32 streams
    python -m bench.serving.serve --only ours --speculative eagle --num-draft-tokens 3 --merge
    python -m bench.serving.serve --only peer --merge          # add (or redo) the peer in an existing serve.json
    python -m bench.serving.serve --peer vllm --out-prefix bench/results/peers_vllm_serve  # vLLM's server as the peer
    python -m bench.serving.serve --only ours --engine-too --schemas 32 --concurrency 64 128 256 --rates \\
        --requests 2048                                        # served against the engine in-process, 32 tools
    python -m bench.serving.serve --requests 4 --peer-requests 2 --max-tokens 8 --json-max-tokens 64 \\
        --concurrency 1 2 --rates 4 --client-procs 2 --warmup 2 --out-prefix /tmp/serve_smoke   # CPU smoke

Load (serve_client.py, with the metrics): --requests per run (the peer: the first --peer-requests), half
chat (fixed length: max_tokens + ignore_eos), half JSON-schema requests of --dataset (response_format, or
forced tool calls with --json-mode tools; they end with the JSON), shuffled with --seed. Per --rates value,
Poisson arrivals; per --concurrency value, C closed-loop workers (--duration: each cycles for that long).
A run stops and cancels what is in flight after --run-timeout s (ours) / --peer-timeout s (the peer).
Before the runs, up to --warmup distinct requests, chat ones of 8 tokens (graphs, grammar compiles). Target (set
for this bench): at 32 streams p50 ITL <= 1.5 ms and >= 10x the peer's out_tok_s; the .md's last lines say.

vLLM (--peer vllm): its OpenAI server (vllm.entrypoints.openai.api_server, staged as docs/peers.md says, only
its wheels on PYTHONPATH: --vllm-site) on the same checkpoint directory, with bench/peers/peers_vllm.py's settings
(serve_servers.start_vllm); it takes the same requests as ours (ignore_eos, response_format, continuous usage).

Peer (`python -m transformers.cli.transformers serve`, written against 5.17 and 5.23, the same flags): the
model directory (resolve_model(--model).path) is the positional FORCE_MODEL and the request's `model`;
--continuous-batching, --attn-implementation --peer-attn (CB runs it as paged|<attn>; bench/peers/peers_hf.py
found paged|eager faster than paged|sdpa without flash-attn), --dtype, --device, and a KV cache sized to the
workload (--cb-num-blocks, --cb-max-batch-tokens 2048: its default of ~90% of free memory is pathologically
slow, see peers_hf.cb_sizing). Flags missing from its --help are dropped (noted in `peer_flags_missing`).
It needs fastapi, uvicorn, pydantic, openai, typer and accelerate (for any device_map), runs offline
(HF_HUB_OFFLINE=1), answers 422 to unknown fields (no ignore_eos: fixed length is a generation_config with
eos_token_id -1), ignores response_format / tool_choice / stream_options (its JSON is unguided) and reports
usage only at the end (no itl_tok).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from bench.common import markdown_table, note, record, write_results
from bench.serving import serve_client as sc
from bench.serving.serve_engine import bench_engine
from bench.serving.serve_servers import (engine_counters, engine_rates, start_ours, start_peer, start_vllm, stop,
                                         ttft_probe)

COLUMNS = ["mode", "load", "x", "ok", "errors", "out_tok_s", "req_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
           "itl_p99_ms", "itl_tok_p50_ms", "tpot_p50_ms", "tpot_p99_ms", "json_valid_frac", "chat_tokens_mean",
           "step_ms", "tokens_per_step", "gpu_idle_frac", "plan_ms", "commit_ms", "io_ms"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["ours", "peer", "both", "engine"], default="both",
                   help="engine: only the engine in-process (serve_engine.py), no server")
    p.add_argument("--peer", choices=["transformers", "vllm"], default="transformers")
    p.add_argument("--vllm-site", default=os.environ.get("SPECDEC_VLLM_SITE", "/root/vllm-site"),
                   help="--peer vllm: the folder holding vLLM and only its wheels")
    p.add_argument("--vllm-prefix-caching", action="store_true", help="let vLLM cache prefixes (ours has none)")
    p.add_argument("--vllm-serve-args", default="", help="more vLLM server flags: --vllm-serve-args=\"--flag value\"")
    p.add_argument("--model", default=os.environ.get("SPECDEC_MODEL") or "default")
    p.add_argument("--speculative", choices=["none", "eagle", "ngram"], default="none")
    p.add_argument("--num-draft-tokens", type=int, default=3)
    p.add_argument("--max-num-seqs", type=int, default=None, help="ours (default: the largest --concurrency)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--json-max-tokens", type=int, default=512)
    p.add_argument("--fixed-length", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--rates", type=float, nargs="*", default=[8, 32, 128])
    p.add_argument("--concurrency", type=int, nargs="*", default=[1, 8, 32])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--peer-requests", type=int, default=64)
    p.add_argument("--duration", type=float, default=None, help="closed loop: seconds per run, not a count")
    p.add_argument("--client-procs", type=int, default=4)
    p.add_argument("--json-frac", type=float, default=0.5)
    p.add_argument("--json-mode", choices=["response_format", "tools"], default="response_format")
    p.add_argument("--dataset", default="JME", choices=list(sc.DATASETS))
    p.add_argument("--schemas", type=int, default=0, metavar="N",
                   help="JSON requests draw from N of the dataset's schemas (an agent's tools), each compiled in the "
                        "warm-up (0: all of them, most compiled on first use)")
    p.add_argument("--engine-too", action="store_true",
                   help="also run the same requests through the engine in-process (serve_engine.py): the rate the "
                        "served one is set against")
    p.add_argument("--data", default=os.environ.get("SPECDEC_DATA", "../shared/data") + "/jsonschemabench")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=64)
    p.add_argument("--run-timeout", type=float, default=120.0)
    p.add_argument("--peer-timeout", type=float, default=60.0, help="the peer's per-run time limit (s)")
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--peer-dtype", default=None, help="default: bfloat16 with CUDA, else float32")
    p.add_argument("--peer-attn", default="eager")
    p.add_argument("--peer-device", default=None, help="default: cuda:0 with a GPU, else cpu")
    p.add_argument("--peer-args", default="", help="more `transformers serve` flags: --peer-args=\"--flag value\"")
    p.add_argument("--out-prefix", default="bench/results/serve")
    p.add_argument("--merge", action="store_true", help="keep an existing JSON's records of other modes")
    p.add_argument("--ttft-prompt-tokens", type=int, default=200,
                   help="ours: after the runs, TTFT at one stream for a chat prompt this long (0: skip)")
    p.add_argument("--single-process-too", action="store_true",
                   help="also run ours with --single-process (engine thread beside the HTTP loop), same run: the A/B")
    p.add_argument("--data-parallel-too", type=int, default=0, metavar="N",
                   help="also run ours with --data-parallel-size N on the one GPU (--data-parallel-share-device), "
                        "same run: the overhead of N engine processes against one")
    p.add_argument("--ours-args", default="", help="more `specdec serve` flags: --ours-args=\"--flag value\"")
    p.add_argument("--ours-cmd", default=None, help=argparse.SUPPRESS)   # replaces `python -m engine.cli serve`
    return p.parse_args(argv)


# ---- servers -----------------------------------------------------------------------------------------------
# ---- runs --------------------------------------------------------------------------------------------------
def run_load(url, model, requests, target, args, load: str, x: float, max_tokens=None, warm=False) -> dict:
    opts = dict(target=target, max_tokens=args.max_tokens, json_max_tokens=args.json_max_tokens,
                fixed_length=args.fixed_length, json_mode=args.json_mode)
    bodies = [sc.request_body(r, model, opts, max_tokens) for r in requests]
    timeout = args.peer_timeout if target == "peer" else args.run_timeout
    cfg = dict(load=load, timeout=timeout, duration=args.duration if load == "closed" and not warm else None)
    per_proc = sc.split_jobs(requests, bodies, load, x, args.client_procs, args.seed + int(x))
    recs = sc.run_clients(url + "/v1/chat/completions", per_proc, cfg)
    return dict(load=load, x=x, **sc.summarize(recs, {r["job"]: r for r in requests}))


def warmup(url, model, requests, target, args) -> None:
    distinct = sc.warm_set(requests, args.warmup, args.schemas)
    if distinct:
        res = run_load(url, model, distinct, target, args, "closed", min(32, len(distinct)), 8, True)
        note(f"{target}: warm-up {res['ok']}/{res['requests']} ok {res['error_example'] or ''}")
        if not res["ok"]:
            raise RuntimeError(f"every warm-up request failed: {res['error_example']}")


def bench_target(variant: str, args, requests, logdir: Path) -> list[dict]:
    """variant: "ours", "ours-1p" (ours with --single-process), "ours-dp" (ours with --data-parallel-too engines
    on one GPU), "peer" (transformers serve) or "vllm"."""
    target = variant if variant in ("peer", "vllm") else "ours"
    reqs = requests[:args.peer_requests] if target == "peer" else requests
    spec = f"+{args.speculative}(K={args.num_draft_tokens})" if args.speculative != "none" else ""
    mode = {"peer": "transformers-serve", "vllm": "vllm-serve" + spec}.get(
        target, "specdec" + spec + {"ours-1p": " one-process",
                                    "ours-dp": f" dp={args.data_parallel_too} shared"}.get(variant, ""))
    head = dict(target=target, mode=mode)
    try:
        if target == "peer":
            proc, url, model, info = start_peer(args, reqs, logdir)
        elif target == "vllm":
            proc, url, model, info = start_vllm(args, reqs, logdir)
        else:
            extra = {"ours-1p": ["--single-process"],
                     "ours-dp": ["--data-parallel-size", str(args.data_parallel_too), "--data-parallel-share-device"]}
            proc, url, model, info = start_ours(args, reqs, logdir, extra.get(variant, []))
    except Exception as e:                          # noqa: BLE001 - recorded; the other target still runs
        note(f"{target}: did not start: {e}")
        return [dict(head, error=f"did not start: {e}"[:3000])]
    head.update(info, served_model=model)
    rows = []
    try:
        warmup(url, model, reqs, target, args)
        for load, xs in (("poisson", args.rates), ("closed", args.concurrency)):
            for x in xs:
                note(f"{head['mode']}: {load} {x} ({len(reqs)} requests)")
                before, t0 = engine_counters(url) if target == "ours" else None, time.perf_counter()
                row = run_load(url, model, reqs, target, args, load, x)
                if before is not None:          # per second of the run itself, not of the client processes' start
                    seconds = row.get("makespan_s") or time.perf_counter() - t0
                    row.update(engine_rates(before, engine_counters(url), seconds))
                rows.append(dict(head, **row))
                print(markdown_table(rows[-1:], COLUMNS).splitlines()[-1], flush=True)
        if target in ("ours", "vllm") and args.ttft_prompt_tokens:
            rows.append(dict(head, **ttft_probe(url, model, args.ttft_prompt_tokens)))
            print(markdown_table(rows[-1:], COLUMNS).splitlines()[-1], flush=True)
    except Exception as e:                          # noqa: BLE001
        note(f"{target}: failed: {e}")
        rows.append(dict(head, error=f"{type(e).__name__}: {e}"[:3000]))
    finally:
        stop(proc)
    return rows


# ---- output ------------------------------------------------------------------------------------------------
def to_record(row: dict, args) -> dict:
    cfg = {k: getattr(args, k) for k in ("max_tokens", "json_max_tokens", "fixed_length", "json_mode", "dataset",
                                         "json_frac", "seed", "client_procs", "duration", "speculative",
                                         "num_draft_tokens")}
    streams = int(row["x"]) if row.get("load") == "closed" else None
    extra = {k: v for k, v in row.items() if k != "mode"}
    return record("serve", row["mode"], args.model, row.get("peer_dtype", "server default"), streams,
                  row.get("output_tokens"), row.get("out_tok_s"), row.get("itl_p50_ms"), **extra, **cfg)


def target_lines(records: list[dict]) -> list[str]:
    at32 = [r for r in records if r.get("load") == "closed" and r.get("x") == 32 and r.get("ok")]
    peer = next((r for r in at32 if r["target"] == "peer"), None)
    vllm = next((r for r in at32 if r["target"] == "vllm"), None)
    out = []
    for ours in (r for r in at32 if r["target"] == "ours"):
        itl = ours["itl_tok_p50_ms"]            # a chunk's gap over the tokens it carries
        line = (f"Target at 32 streams, {ours['mode']}: p50 ITL {ours['itl_p50_ms']} ms per chunk, {itl} ms per "
                f"token (<= 1.5 ms per token: {'yes' if itl is not None and itl <= 1.5 else 'no'})")
        if peer and peer.get("out_tok_s"):
            ratio = ours["out_tok_s"] / peer["out_tok_s"]
            line += (f"; {ours['out_tok_s']:.0f} tok/s = {ratio:.1f}x the peer's {peer['out_tok_s']:.0f} "
                     f"(>= 10x: {'yes' if ratio >= 10 else 'no'})")
        if vllm and vllm.get("out_tok_s"):
            line += (f"; {ours['out_tok_s'] / vllm['out_tok_s']:.2f}x vLLM's {vllm['out_tok_s']:.0f} tok/s, per-token "
                     f"ITL {itl} vs {vllm.get('itl_tok_p50_ms')} ms")
        out.append(line + ".")
    plain = {r["x"]: r for r in records if r.get("load") == "closed" and r.get("ok") and r["mode"] == "specdec"}
    for r in records:
        if " dp=" in r["mode"] and r.get("load") == "closed" and r.get("ok") and plain.get(r["x"], {}).get("out_tok_s"):
            ratio = r["out_tok_s"] / plain[r["x"]]["out_tok_s"]
            out.append(f"{r['mode']} at {r['x']} streams: {ratio:.2f}x one engine's tok/s (>= 1.0: "
                       f"{'yes' if ratio >= 1.0 else 'no'}).")
    out += served_lines(records)
    return out or ["Target: no successful run of ours at 32 streams."]


def served_lines(records: list[dict]) -> list[str]:
    """Served tok/s against the engine's in-process at the same concurrency (target: >= 0.9)."""
    engine = {r["x"]: r for r in records if r.get("target") == "engine" and r.get("out_tok_s")}
    out = []
    for r in records:
        if r.get("load") == "closed" and r.get("target") == "ours" and r.get("out_tok_s") and r["x"] in engine:
            ratio = r["out_tok_s"] / engine[r["x"]]["out_tok_s"]
            out.append(f"{r['mode']} at {r['x']} streams: {ratio:.2f}x the engine in-process "
                       f"({r['out_tok_s']:,.0f} against {engine[r['x']]['out_tok_s']:,.0f} tok/s; >= 0.9: "
                       f"{'yes' if ratio >= 0.9 else 'no'}).")
    return out


def _value(r: dict, key: str):
    """per_token_ms: a chunk's gap over the tokens it carries (ours: chunks grow under load), else TPOT (the
    peer's usage comes only at the end)."""
    if key == "per_token_ms":
        return r.get("itl_tok_p50_ms") if r.get("itl_tok_p50_ms") is not None else r.get("tpot_p50_ms")
    return r.get(key)


def plot_runs(records: list[dict], path: Path) -> None:
    try:
        import matplotlib
        import matplotlib.ticker
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        note("matplotlib is not installed; no plot")
        return
    panels = [(load, xlabel) for load, xlabel in (("closed", "concurrent streams"), ("poisson", "arrival rate (req/s)"))
              if any(r.get("load") == load for r in records)] or [("closed", "concurrent streams")]
    fig, axes = plt.subplots(2, len(panels), figsize=(5 * len(panels), 7), squeeze=False)
    for col, (load, xlabel) in enumerate(panels):
        for row, (key, ylabel) in enumerate((("out_tok_s", "output tokens/s"),
                                             ("per_token_ms", "p50 ms per output token"))):
            ax = axes[row][col]
            for mode in sorted({r["mode"] for r in records}):
                pts = sorted((r["x"], _value(r, key)) for r in records if r["mode"] == mode
                             and r.get("load") == load and isinstance(_value(r, key), (int, float)))
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
            ax.set(xlabel=xlabel, ylabel=ylabel, xscale="log", yscale="log")
            ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.grid(True, alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend()
    fig.suptitle("OpenAI-compatible serving under load")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote plot {path}")


def main(argv=None):
    args = parse_args(argv)
    requests = sc.build_requests(args.requests, args.seed, args.json_frac, args.data, args.dataset, args.schemas)
    logdir = Path(tempfile.mkdtemp(prefix="specdec-serve-bench-"))
    note(f"server logs in {logdir}")
    peer = "vllm" if args.peer == "vllm" else "peer"
    targets = {"both": ["ours", peer], "ours": ["ours"], "peer": [peer], "engine": []}[args.only]
    if args.single_process_too and "ours" in targets:
        targets.insert(0, "ours-1p")
    if args.data_parallel_too > 1 and "ours" in targets:
        targets.insert(targets.index("ours") + 1, "ours-dp")
    # a timeout's SIGTERM unwinds through bench_target's `finally`, so no server outlives the bench holding GPU memory
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    print(markdown_table([], COLUMNS), flush=True)
    partial = Path(args.out_prefix + ".partial.json")       # each target's rows as it ends, in case a later one hangs
    partial.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for t in targets:
        rows += bench_target(t, args, requests, logdir)
        partial.write_text(json.dumps(rows, indent=1, default=str))
    if args.engine_too or args.only == "engine":
        rows += bench_engine(args, requests)
    records = [to_record(r, args) for r in rows]        # after the servers stopped: device_name() may init CUDA
    out = Path(args.out_prefix + ".json")
    if args.merge and out.exists():                     # replace this run's modes, keep the others
        modes = {r["mode"] for r in records}
        records = [r for r in json.loads(out.read_text()) if r.get("mode") not in modes] + records
    write_results(records, out)
    lines = [f"Command: `{records[-1]['command']}` on {records[-1]['device']}, commit {records[-1]['git_commit']}.",
             "", markdown_table(records, COLUMNS), ""] + target_lines(records)
    failed = [f"- {r['mode']}: {' '.join(r['error'].split())[:600]}" for r in records if r.get("error")]
    text = "\n".join(lines + ([""] + failed if failed else []))
    out.with_suffix(".md").write_text(text + "\n")
    print(text)
    plot_runs(records, out.with_suffix(".png"))
    partial.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
