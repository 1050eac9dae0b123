"""Train an EAGLE-3-style draft head for the engine's model by self-distillation.

    python -m specdec.train_head --out runs/head                 # generate, train, export, default model
    python -m specdec.train_head --out runs/head --stage generate --time-limit 430      # again to go on
    python -m specdec.train_head --out runs/head --stage train --time-limit 480         # again to go on
    python -m specdec.train_head --out runs/head --stage export --ship specdec/heads/smollm2-135m
    CUDA_VISIBLE_DEVICES=$i python -m specdec.train_head --out runs/head --stage generate --shard $i/4   # 4 GPUs

The defaults train a head from scratch: 90 K chat prompts (every fourth with a second turn), 4 K tool
conversations and every Glaive / Github_easy schema in 4 phrasings, each answered under its grammar and, as the
fourth head's data added, without it; 12 K steps of batch 32. The shipped head's card.md lists the exact runs
behind each version (each later one continues the one before with --init).

Stages (each resumes from what --out already holds, so a 10-minute device call can stop and go on):
- generate: our engine answers chat prompts, schema prompts and tool conversations (specdec/eagle/prompts.py,
  data.py), in chunks of JSONL under OUT/data (or --data-dir);
- train: EAGLE-3 training-time test on those responses, the target frozen; checkpoints OUT/ckpt.pt;
  a held-out slice (every 50th response) gives the offline acceptance length;
- export: OUT/head.safetensors + head.json (config) + card.md (data, steps, time, loss, acceptance),
  copied to --ship if given.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from engine.speculative.eagle_head import new_head
from specdec.eagle import data as head_data
from specdec.eagle.train import Target, evaluate, train


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m specdec.train_head", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--stage", choices=["all", "generate", "train", "export"], default="all")
    p.add_argument("--model", default=None, help="engine model spec (default: the default model)")
    p.add_argument("--device", default="auto")
    p.add_argument("--data", default=os.environ.get("SPECDEC_DATA", "../shared/data") + "/jsonschemabench",
                   help="schema data root (Glaive, Github_easy prompts); '' for chat prompts only")
    p.add_argument("--data-dir", default=None, help="where the responses are (default OUT/data); runs of a "
                   "data-size study share one")
    p.add_argument("--num-chat", type=int, default=90000,
                   help="chat prompts (distinct ones first, then sampled repeats)")
    p.add_argument("--followup-every", type=int, default=4,
                   help="every N-th chat prompt gets a second user turn (0: none)")
    p.add_argument("--num-tools", type=int, default=4000, help="two-turn tool conversations (Glaive functions)")
    p.add_argument("--schema-variants", type=int, default=4,
                   help="phrasings each schema is asked in, under its grammar")
    p.add_argument("--free-schema-variants", type=int, default=4, help="phrasings each schema is also asked in "
                   "without its grammar (the unguided answers that unguided JSON requests draft over)")
    p.add_argument("--max-sequences", type=int, default=0, help="train on the first N sequences only (0: all)")
    p.add_argument("--skip-kinds", nargs="*", default=[], metavar="KIND", help="train without these kinds of "
                   f"response ({', '.join(sorted(head_data.KINDS))}); the held-out set keeps them")
    p.add_argument("--shard", default="0/1", metavar="I/N", help="generate: only every N-th chunk from the I-th, "
                   "so N processes (one a GPU: CUDA_VISIBLE_DEVICES) share one --data-dir")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--chunk", type=int, default=2048, help="items per chunk file (resume unit)")
    p.add_argument("--max-seqs", type=int, default=512, help="engine batch while generating")
    p.add_argument("--steps", type=int, default=12000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--depth", type=int, default=3, help="unrolled draft steps (training-time test)")
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--time-limit", type=float, default=None, help="seconds; stop cleanly (resumable) after")
    p.add_argument("--decay", choices=["time", "steps"], default="time", help="learning-rate decay over the planned "
                   "steps or this call's time limit, whichever ends first (time), or over the planned steps only, "
                   "for one schedule across resumed calls (steps)")
    p.add_argument("--bucket", type=int, default=1, help="draw B batches' worth and keep one of similar lengths "
                   "(less padding); 1: plain random batches")
    p.add_argument("--init", default=None, help="start training from this exported head directory (head.json + "
                   "head.safetensors) instead of a random head; a checkpoint under --out still wins")
    p.add_argument("--ship", default=None, help="copy the exported head here")
    return p.parse_args(argv)


def run_generate(args) -> None:
    from engine.llm_engine import LLMEngine
    part = shard(args.shard)
    kw = dict(max_num_seqs=args.max_seqs) | ({"model": args.model} if args.model else {})
    eng = LLMEngine(**kw, **({} if args.device == "auto" else {"device": args.device}))
    items = head_data.prompt_items(args.data or None, args.num_chat, schema_variants=args.schema_variants,
                                   followup_every=args.followup_every, num_tools=args.num_tools,
                                   free_schema_variants=args.free_schema_variants)
    deadline = time.monotonic() + args.time_limit if args.time_limit else None
    head_data.generate(eng, items, data_dir(args), args.chunk, args.max_tokens, log, deadline, part)
    eng.close()


def shard(text: str) -> tuple[int, int]:
    index, _, count = text.partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        i, n = -1, 0
    if not 0 <= i < n:
        raise SystemExit(f"--shard {text!r}: give I/N with 0 <= I < N")
    return i, n


def data_dir(args) -> str:
    return args.data_dir or os.path.join(args.out, "data")


def load_target(args):
    from transformers import AutoModelForCausalLM
    from engine.config import EngineConfig
    from engine.models.loader import resolve_model
    source = resolve_model(args.model or os.environ.get("SPECDEC_MODEL", "default"))
    config = EngineConfig(device=args.device)           # the engine's rule for "auto": bf16 on CUDA, else fp32
    device, dtype = config.torch_device(), config.torch_dtype()
    model = AutoModelForCausalLM.from_pretrained(str(source.path), dtype=dtype).to(device)
    return source, model, device, dtype


def run_train(args) -> dict:
    unknown = set(args.skip_kinds) - head_data.KINDS          # before seconds of loading
    if unknown:
        raise SystemExit(f"--skip-kinds: unknown kind(s) {', '.join(sorted(unknown))}; the kinds are "
                         f"{', '.join(sorted(head_data.KINDS))}")
    source, model, device, dtype = load_target(args)
    head = initial_head(args, source.config, device)
    target = Target(model, head.cfg.feature_layers)
    records = head_data.load_records(data_dir(args), args.max_len)
    if len(records) < 2:
        raise SystemExit(f"no training data under {data_dir(args)}: run --stage generate first")
    train_records, held = head_data.split(records)
    held_out = held["all"]
    # a data-size study trains on the first N: the same held-out set, less training data
    train_records = [r for r in train_records if r[2] not in args.skip_kinds][:args.max_sequences or None]
    train_seqs = [(ids, p) for ids, p, _ in train_records]
    log(f"train: {len(train_seqs)} sequences, {len(held_out)} held out, "
        f"head {sum(p.numel() for p in head.parameters()):,} params")
    t0 = time.monotonic()
    # the head trains in float32 (the target runs in bfloat16 on CUDA): it is small, and bf16 rounding of its
    # residual stream stalled the loss in a first run
    summary = train(head, target, train_seqs, held_out, out_dir=args.out, steps=args.steps, batch=args.batch,
                    lr=args.lr, depth=args.depth, time_limit_s=args.time_limit, decay=args.decay, bucket=args.bucket,
                    log=log)
    summary.update(train_s=round(time.monotonic() - t0, 1), sequences=len(train_seqs),
                   tokens=sum(len(s) - p for s, p in train_seqs), held_out=len(held_out), batch=args.batch,
                   kinds=dict(Counter(k for _, _, k in train_records)),
                   lr=args.lr, depth=args.depth, max_len=args.max_len, decay=args.decay, bucket=args.bucket,
                   init=args.init, skip_kinds=args.skip_kinds,
                   command="python -m specdec.train_head " + " ".join(sys.argv[1:]))
    prev = Path(args.out) / "train_summary.json"
    if prev.exists():                      # a resumed run adds its time to the earlier calls'
        summary["train_s"] += json.loads(prev.read_text()).get("train_s", 0)
    prev.write_text(json.dumps({k: v for k, v in summary.items() if k != "losses"}
                               | {"last_losses": summary["losses"][-20:]}, indent=2))
    log(f"train: {summary['step']} steps, done={summary['done']}, acceptance={summary.get('held_out_acceptance')}")
    return summary


def initial_head(args, target_config: dict, device):
    """A random head, or (--init) an exported one to go on training: float32, trainable."""
    if not args.init:
        return new_head(target_config, torch.float32, device)
    from engine.speculative.eagle_head import HeadConfig
    from engine.speculative.eagle_paged import load_head
    head = load_head(args.init, torch.float32, device).train().requires_grad_(True)
    if head.cfg != HeadConfig.for_target(target_config):   # export rebuilds the head from the target's config
        raise ValueError(f"--init {args.init}: its head config {head.cfg} is not the one this trainer builds for "
                         f"the model ({HeadConfig.for_target(target_config)})")
    log(f"train: starting from the head in {args.init}")
    return head


def run_export(args) -> None:
    from safetensors.torch import save_file
    source, model, device, _ = load_target(args)
    head = new_head(source.config, torch.float32, device)
    state = torch.load(os.path.join(args.out, "ckpt.pt"), map_location=device)
    head.load_state_dict(state["head"])
    out = Path(args.out)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in head.state_dict().items()},
              str(out / "head.safetensors"))
    (out / "head.json").write_text(json.dumps(head.cfg.to_dict() | {"target": source.name}, indent=2))
    summary = json.loads((out / "train_summary.json").read_text()) if (out / "train_summary.json").exists() else {}
    _, held = head_data.split(head_data.load_records(data_dir(args), args.max_len))
    target = Target(model, head.cfg.feature_layers)
    acc = {name: {k: round(evaluate(head, target, seqs, k), 3) for k in (1, 3, 5)} for name, seqs in held.items()}
    (out / "acceptance.json").write_text(json.dumps(acc | {"summary": summary}, indent=2))
    (out / "card.md").write_text(card(source.name, summary, state, acc, args))
    log(f"export: {out / 'head.safetensors'} ({(out / 'head.safetensors').stat().st_size / 1e6:.1f} MB), "
        f"offline acceptance {acc}")
    if args.ship:
        os.makedirs(args.ship, exist_ok=True)
        for name in ("head.safetensors", "head.json", "card.md"):
            shutil.copy(out / name, Path(args.ship) / name)


def card(target: str, summary: dict, state: dict, acc: dict, args) -> str:
    losses = state.get("losses", [])
    kinds = ", ".join(f"{k} {v:,}" for k, v in sorted(summary.get("kinds", {}).items()))
    if summary.get("skip_kinds"):
        kinds += f" (left out of training: {', '.join(summary['skip_kinds'])})"
    rows = "\n".join(f"  - {name}: {' / '.join(f'{v:.2f}' for v in by_k.values())}" for name, by_k in acc.items())
    return f"""# EAGLE-3-style draft head for {target}

- Data: self-distillation, the target's own responses (<= {args.max_tokens} tokens; greedy, and sampled at 0.8
  for repeated prompts): {summary.get('sequences', '?')} training sequences ({summary.get('tokens', '?')} response
  tokens) by kind: {kinds or '?'}. Chat prompts come from task families x styles, some with a second turn;
  schema prompts (Glaive, Github_easy) and tool conversations (Glaive functions, through the server's chat format)
  are answered under their grammar; schema_free are the same schema prompts answered without it
  (specdec/eagle/prompts.py, data.py). JSON Mode Eval, BFCL and the chat questions bench/spec/spec.py asks are held
  out entirely (it measures on them).
- Training: {f"from the head in {summary['init']}, then " if summary.get('init') else ''}{state.get('step')} steps, \
batch {summary.get('batch')}, lr {summary.get('lr')}, training-time test
  depth {summary.get('depth')}, sequences cut to {summary.get('max_len')} tokens, {summary.get('train_s', '?')} s.
  Loss (sum over the unrolled steps) first / last 20 steps: {_mean(losses[:20])} / {_mean(losses[-20:])}.
- Offline acceptance length (greedy, every 50th response held out, K = 1 / 3 / 5):
{rows}
- Commands: `{summary.get('command', '?')}`, then `python -m specdec.train_head {' '.join(sys.argv[1:])}`
"""


def _mean(xs) -> str:
    return f"{sum(xs) / len(xs):.3f}" if xs else "?"


def main(argv=None) -> None:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.stage in ("all", "generate"):
        run_generate(args)
    if args.stage in ("all", "train"):
        summary = run_train(args)
        if not summary["done"]:
            return
    if args.stage in ("all", "export"):
        run_export(args)


if __name__ == "__main__":
    main()
