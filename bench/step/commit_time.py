"""Host time per committed token: engine/requests/output.py's OutputProcessor vs the old whole-output decode.

One request at a time, one token per commit, two stop strings that never complete (so every request runs to
its length), the default model's tokenizer, on the CPU. "new" is OutputProcessor.commit + output (incremental
detokenization, stop search in the new text only, streamed text); "old" is what engine/llm_engine.py did per
token: tokenizer.decode(all output ids) and an `in` search of every stop string (its stream() decoded the
whole output once more). Reported per length N: the mean over the request's N commits, and the median of its
last tenth (the cost of a commit at about N tokens), each the best of --repeats runs.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from bench.common import (QUESTIONS, REPO, command_line, cpu_model, git_commit, markdown_table, note, plot, record,
                          write_results)
from engine.requests.output import OutputProcessor
from engine.requests.sequence import SamplingParams, Sequence

try:
    from engine.models.loader import load_tokenizer, resolve_model
except ImportError:                          # before the loader moved to engine/models
    from engine.loader import load_tokenizer, resolve_model

LENGTHS = (100, 500, 1000, 2000, 4000)
STOPS = ("The capital of Spain", "\n\nUser:")    # "The capital of" and "\n\n" occur: the hold-back works
FILLER = ("The capital of France is Paris; the capital of Japan is Tokyo (東京), naïve café au lait ☕.\n\n"
          "Answer: {q} It depends on the details, so let us go through them one by one.\n")


def output_tokens(tokenizer, n: int) -> list[int]:
    text, ids, i = "", [], 0
    while len(ids) < n:
        text += FILLER.format(q=QUESTIONS[i % len(QUESTIONS)])
        ids, i = tokenizer.encode(text), i + 1
    return ids[:n]


def time_new(tokenizer, eos, ids) -> list[float]:
    proc = OutputProcessor(tokenizer, eos)
    seq = Sequence(0, [1, 2, 3], SamplingParams(max_tokens=len(ids), stop=STOPS), seed=0)
    proc.start(seq)
    times, clock = [], time.perf_counter
    for token in ids:
        t0 = clock()
        reason = proc.commit(seq, (token,))
        proc.output(seq, 1, reason is not None, reason)
        times.append(clock() - t0)
    if seq.out.reason != "length":
        raise RuntimeError(f"the request ended early ({seq.out.reason}): a stop string occurs in the text")
    return times


def time_old(tokenizer, eos, ids) -> list[float]:
    out, times, clock = [], [], time.perf_counter
    for token in ids:
        t0 = clock()
        out.append(token)
        if token not in eos:
            text = tokenizer.decode(out)
            hits = [text.find(s) for s in STOPS if s in text]
            if hits:
                raise RuntimeError("a stop string occurs in the text")
        times.append(clock() - t0)
    return times


def measure(tokenizer, eos, ids, fn, repeats: int) -> tuple[float, float]:
    """(mean µs per commit over the request, median µs of its last tenth), each the best of `repeats`: the
    host is shared, and interference only ever adds time."""
    runs = [fn(tokenizer, eos, ids) for _ in range(repeats)]
    tail = max(1, len(ids) // 10)
    mean = min(sum(r) / len(r) for r in runs)
    end = min(statistics.median(r[-tail:]) for r in runs)
    return mean * 1e6, end * 1e6


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "commit_time.json"))
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    source = resolve_model("default")
    tokenizer = load_tokenizer(source)
    eos = frozenset({tokenizer.eos_token_id})
    all_ids = output_tokens(tokenizer, max(args.lengths))
    device, commit, records = cpu_model(), git_commit(), []
    for n in args.lengths:
        new, new_end = measure(tokenizer, eos, all_ids[:n], time_new, args.repeats)
        old, old_end = measure(tokenizer, eos, all_ids[:n], time_old, args.repeats)
        note(f"{n} tokens: new {new:.1f} us, old {old:.1f} us per commit")
        rec = record("commit_time", "host", source.name, None, 1, n, None, None, us_per_token_new=new,
                     us_per_token_old=old, speedup=old / new, us_at_end_new=new_end, us_at_end_old=old_end,
                     stops=list(STOPS), repeats=args.repeats)
        rec.update(device=device, commit=commit, cmdline=command_line())
        records.append(rec)
    out = write_results(records, args.out)
    lines = [(dict(new_tokens=r["new_tokens"], path=p, us_per_token=r[f"us_per_token_{p}"]))
             for r in records for p in ("old", "new")]
    plot(lines, "new_tokens", "us_per_token", "path", out.with_suffix(".png"),
         "host time per committed token (2 stop strings)", logy=True)
    table = markdown_table(records, ["new_tokens", "us_per_token_old", "us_per_token_new", "speedup",
                                     "us_at_end_old", "us_at_end_new"])
    out.with_suffix(".md").write_text(
        f"Command: `{command_line()}` on {device} (CPU), commit {commit}.\n\n"
        f"## Host time per committed token, µs (one request, one token per commit, stops {STOPS!r})\n\n"
        f"{table}\n")
    print(table)


if __name__ == "__main__":
    sys.exit(main())
