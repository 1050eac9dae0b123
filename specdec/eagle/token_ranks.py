"""`python -m specdec.eagle.token_ranks`: the target's response tokens ranked by frequency, for a draft vocabulary.

    python -m specdec.eagle.token_ranks --data-dir OUT/data --out token_ranks.json [--keep 32768]

Reads the responses `specdec.train_head --stage generate` wrote (the target's own outputs), counts each token of
every response, and writes the token ids most frequent first (then the ones never seen, by id) with their counts.
Tuning.spec_draft_vocab takes the file and Tuning.spec_draft_vocab_size its first N ids: the EAGLE head then drafts
only from those rows of the LM head (a smaller matmul each draft step, as EAGLE-3's reduced draft vocabulary).
Every `--holdout-every`-th response is left out of the counts and scored instead: the share of its tokens a draft
vocabulary of each `--sizes` covers, by response kind (a draft outside it is always rejected).
"""
from __future__ import annotations

import argparse
import json
from collections import Counter

from specdec.eagle.data import load_records


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m specdec.eagle.token_ranks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True, help="chunk_*.jsonl of generated responses")
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the largest id seen + 1)")
    p.add_argument("--holdout-every", type=int, default=10, help="every N-th response scores coverage (0: none)")
    p.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    p.add_argument("--max-len", type=int, default=1 << 20)
    p.add_argument("--keep", type=int, default=0, help="write only the first N ranked ids (0: all)")
    args = p.parse_args(argv)
    if args.holdout_every < 0 or any(n < 1 for n in args.sizes) or args.keep < 0:
        p.error("--holdout-every and --keep must be >= 0 and every size >= 1")
    return args


def rank(counts: Counter, vocab: int) -> list[int]:
    """Every id in [0, vocab): counted ones by count (ties by id), then the rest by id."""
    seen = sorted(counts, key=lambda t: (-counts[t], t))
    rest = sorted(set(range(vocab)) - set(seen))
    return seen + rest


def coverage(ranked: list[int], responses: list[list[int]], sizes: list[int]) -> dict[int, float]:
    """The share of the responses' tokens among the first n ranked ids, for each n in sizes."""
    position = {t: i for i, t in enumerate(ranked)}
    tokens = [t for r in responses for t in r]
    total = max(len(tokens), 1)
    return {n: sum(position.get(t, len(ranked)) < n for t in tokens) / total for n in sizes}


def main(argv=None) -> dict:
    args = parse_args(argv)
    records = load_records(args.data_dir, args.max_len)
    if not records:
        raise SystemExit(f"no responses under {args.data_dir}")
    every = args.holdout_every
    train = [r for i, r in enumerate(records) if not every or i % every]
    held = [r for i, r in enumerate(records) if every and not i % every]
    counts = Counter(t for ids, p, _ in train for t in ids[p:])
    vocab = args.vocab or max(t for ids, _, _ in records for t in ids) + 1
    ranked = rank(counts, vocab)
    kinds = sorted({k.split("_")[0] for _, _, k in held})
    scores = {"all": coverage(ranked, [ids[p:] for ids, p, _ in held], args.sizes)}
    for kind in kinds:
        scores[kind] = coverage(ranked, [ids[p:] for ids, p, k in held if k.split("_")[0] == kind], args.sizes)
    kept = ranked[:args.keep] if args.keep else ranked
    out = dict(token_ids=kept, counts=[counts.get(t, 0) for t in kept], responses=len(train),
               tokens=sum(counts.values()), distinct=len(counts), held_out_responses=len(held),
               coverage={k: {str(n): v for n, v in s.items()} for k, s in scores.items()})
    with open(args.out, "w") as f:
        json.dump(out, f, separators=(",", ":"))
    print(f"{len(train)} responses, {out['tokens']:,} tokens, {len(counts):,} distinct ids; held-out coverage:")
    print("| held out | " + " | ".join(str(n) for n in args.sizes) + " |")
    print("|---" * (len(args.sizes) + 1) + "|")
    for k, s in scores.items():
        print(f"| {k} | " + " | ".join(f"{v:.4f}" for v in s.values()) + " |")
    return out


if __name__ == "__main__":
    main()
