"""`python -m specdec.acceptance.tree_study`: tree drafts against chains, offline (specdec/acceptance/trees.py).

1. The engine, without speculation, decodes each dataset's prompts greedily: the responses a greedy
   speculating engine must reproduce.
2. The target (Hugging Face, on the same weights) gives each prompt + response its feature-layer hidden states;
   the head unrolls `--depth` teacher-forced draft steps over them (`unrolled_logits`), and each step's rank of
   the target's token is kept: ranks [response positions, depth] per response (cached in --cache).
3. Chains K = 1..depth, and the best tree of each size in --nodes, are walked over the responses as the engine
   would decode them. Trees are fitted on one half of every dataset's responses (pooled: one tree for all
   sets, as an engine would ship it) and measured on the other half, then the halves swap.
With --cache DIR each dataset's responses and ranks are kept as they are done; a rerun computes only what is
missing (another --nodes or a shallower --depth costs seconds).

Acceptance here is exact for greedy verification up to numerics (the engine runs bf16 on a GPU).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from specdec.acceptance import trees
from specdec.acceptance.report import table
from specdec.revision import git_commit
from specdec.datasets import CHAT

NODES = [3, 4, 6, 8, 12, 16, 24, 32, 48, 64]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m specdec.acceptance.tree_study", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", nargs="+", default=["JME", "BFCL", CHAT], metavar="NAME|NAME=PATH")
    p.add_argument("--data", default=None, metavar="ROOT", help="holds maskbench/ (default: tests/data)")
    p.add_argument("--head", default=None, metavar="DIR", help="head directory (default: the shipped one)")
    p.add_argument("--model", default=None)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--depth", type=int, default=6, help="deepest draft (chains K = 1..depth)")
    p.add_argument("--nodes", type=int, nargs="+", default=NODES, help="tree sizes (draft nodes)")
    p.add_argument("--device", default="auto")
    p.add_argument("--batch", type=int, default=4, help="responses per teacher-forced pass")
    p.add_argument("--cache", default=None, metavar="DIR", help="keeps each dataset's responses and ranks; a "
                   "rerun reuses them")
    p.add_argument("--out", default="bench/results/tree_acceptance.json")
    args = p.parse_args(argv)
    for name in ("prompts", "max_tokens", "depth", "batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if any(n < 1 for n in args.nodes):
        p.error("--nodes: every size must be >= 1")
    return args


def generate(args, device, items: list[str]):
    """Yields (dataset name, [(prompt ids, greedy response ids)]) from the engine without speculation."""
    from engine.llm_engine import LLMEngine
    from engine.requests.sequence import SamplingParams
    from specdec.datasets import load_dataset
    kw = {"model": args.model} if args.model else {}
    eng = LLMEngine(device=str(device), max_num_seqs=min(args.prompts, 32), **kw)
    try:
        for item in items:
            ds = load_dataset(eng, item, args.data, args.prompts)
            prompts = [p for p in ds.prompts if len(p) + args.max_tokens <= eng.max_model_len]
            seqs = eng.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0))
            _note(f"{ds.name}: {len(prompts)} responses, {sum(len(s.output_token_ids) for s in seqs)} tokens")
            yield ds.name, [(p, list(s.output_token_ids)) for p, s in zip(prompts, seqs)]
    finally:
        eng.close()


def head_ranks(args, device, responses: dict):
    """Yields (dataset name, [ranks [len(response), depth] per response]): row j drafts from the response's
    (j - 1)-th token (row 0: the prompt's last), depth i scores response token j + 1 + i."""
    from engine.speculative.eagle_head import unrolled_logits
    from engine.speculative.eagle_paged import HEADS, load_head
    from specdec.eagle.train import Target
    from specdec.train_head import load_target
    _, model, device, dtype = load_target(argparse.Namespace(model=args.model, device=str(device)))
    head = load_head(args.head or HEADS / "smollm2-135m", dtype, device)
    target = Target(model, head.cfg.feature_layers)
    for name, pairs in responses.items():
        out = []
        for i in range(0, len(pairs), args.batch):
            out += _batch_ranks(head, target, pairs[i:i + args.batch], args.depth, device, unrolled_logits)
        _note(f"{name}: ranks of {len(pairs)} responses")
        yield name, out


def collect(args, device) -> dict[str, list[torch.Tensor]]:
    """{dataset: ranks per response}, each dataset's responses and ranks kept under --cache as soon as they are
    done, so that a rerun (another --nodes, a shallower --depth, an interrupted run) computes only what is
    missing."""
    from specdec.datasets import parse_dataset
    cache = Path(args.cache) if args.cache else None
    if cache:
        cache.mkdir(parents=True, exist_ok=True)
    names = {item: parse_dataset(item, args.data)[0] for item in args.datasets}
    ranks = {}
    for n in names.values():
        f = cache / f"{n}.ranks.pt" if cache else None
        saved = torch.load(f) if f and f.exists() else None
        if saved and saved["depth"] >= args.depth:
            ranks[n] = [r[:, :args.depth] for r in saved["ranks"]]
    need = {item: n for item, n in names.items() if n not in ranks}
    responses = {n: json.loads((cache / f"{n}.responses.json").read_text()) for n in need.values()
                 if cache and (cache / f"{n}.responses.json").exists()}
    todo = [item for item, n in need.items() if n not in responses]
    for name, pairs in generate(args, device, todo) if todo else ():
        responses[name] = pairs
        if cache:
            (cache / f"{name}.responses.json").write_text(json.dumps(pairs))
    for name, rs in head_ranks(args, device, responses) if responses else ():
        ranks[name] = rs
        if cache:
            torch.save(dict(ranks=rs, depth=args.depth), cache / f"{name}.ranks.pt")
    return {n: ranks[n] for n in names.values()}


@torch.no_grad()
def _batch_ranks(head, target, pairs, depth: int, device, unrolled_logits) -> list[torch.Tensor]:
    seqs = [p + r for p, r in pairs]
    t = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), t, dtype=torch.long)
    attn = torch.zeros_like(ids)
    select = torch.zeros(len(seqs), t, dtype=torch.bool)
    for b, ((p, r), s) in enumerate(zip(pairs, seqs)):
        ids[b, :len(s)], attn[b, :len(s)] = torch.tensor(s), 1
        select[b, len(p) - 1:len(s) - 1] = True            # drafts from the prompt's last token to the response's
    ids, attn, select = ids.to(device), attn.to(device), select.to(device)
    feats = target.features(ids, attn).to(head.fc.weight.dtype)
    logits = unrolled_logits(head, feats, target.embed, ids, target.final_norm, target.lm_head, depth, select=select)
    pos = torch.arange(t, device=device)[None, :].expand_as(ids)[select]
    seq = torch.arange(len(seqs), device=device)[:, None].expand_as(ids)[select]
    lens = attn.sum(1)
    cols = []
    for i, lg in enumerate(logits):                         # step i at position q scores token q + 2 + i
        want = pos + 2 + i
        label = torch.where(want < lens[seq], ids[seq, want.clamp(max=t - 1)], trees.NO_LABEL)
        cols.append(trees.label_ranks(lg.float(), label))
    ranks = torch.stack(cols, dim=1).cpu()
    counts = select.sum(1).tolist()
    return list(ranks.split(counts))


def evaluate(ranks: dict[str, list[torch.Tensor]], depth: int, nodes: list[int],
             max_tokens: int | None = None) -> tuple[list[dict], dict]:
    """Rows (dataset, method, nodes, depth, acceptance) for chains and cross-fitted pooled trees, and the trees
    fitted on all responses ({nodes: sorted paths})."""
    rows = []
    for name, resp in ranks.items():
        for k in range(1, depth + 1):
            rows.append(dict(dataset=name, method="chain", nodes=k, depth=k,
                             acceptance=round(trees.acceptance(resp, trees.chain(k), max_tokens), 3)))
    halves = [{n: r[h::2] for n, r in ranks.items()} for h in (0, 1)]
    fitted = [_pooled_counts(h) for h in halves]
    for n in nodes:
        folds = [(trees.best_tree(fitted[0], n, depth), halves[1]), (trees.best_tree(fitted[1], n, depth), halves[0])]
        for name in ranks:
            tokens, steps = map(sum, zip(*(trees.totals(test[name], tree, max_tokens) for tree, test in folds)))
            rows.append(dict(dataset=name, method="tree", nodes=n, depth=trees.tree_depth(folds[0][0]),
                             acceptance=round(tokens / max(steps, 1), 3)))
    full = _pooled_counts(ranks)
    shapes = {n: sorted(trees.best_tree(full, n, depth), key=lambda p: (len(p), p)) for n in nodes}
    return rows, shapes


def _pooled_counts(ranks: dict) -> Counter:
    counts: Counter = Counter()
    for resp in ranks.values():
        for r in resp:
            counts.update(trees.prefix_counts(r))
    return counts


def _note(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv=None) -> list[dict]:
    from engine.config import EngineConfig
    from specdec.acceptance.tree_report import write_report
    args = parse_args(argv)
    device = EngineConfig(device=args.device).torch_device()      # the engine's rule for "auto"
    t0 = time.monotonic()
    ranks = collect(args, device)
    meta = dict(device=str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
                git_commit=git_commit(), responses={n: len(r) for n, r in ranks.items()},
                tokens={n: sum(x.shape[0] for x in r) for n, r in ranks.items()})
    rows, shapes = evaluate(ranks, args.depth, args.nodes, args.max_tokens)
    meta.update(command="python -m specdec.acceptance.tree_study " + " ".join(sys.argv[1:] if argv is None else argv),
                depth=args.depth, seconds=round(time.monotonic() - t0, 1), head=args.head or "shipped")
    write_report(rows, shapes, ranks, meta, args.out)
    print(table(["dataset", "method", "nodes", "depth", "acceptance"],
                [[r[c] for c in ("dataset", "method", "nodes", "depth", "acceptance")] for r in rows]))
    return rows


if __name__ == "__main__":
    main()
