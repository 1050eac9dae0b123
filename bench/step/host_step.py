"""The host's share of a decode step without the device: plan (schedule + prepare), launch and commit per step,
the forward replaced by nothing, on the CPU.

    python -m bench.step.host_step                               # 1, 8 and 32 streams, 3 rounds
    PYTHONPATH=.old python -m bench.step.host_step --tag before  # another tree's engine, same script
    python -m bench.step.host_step --streams 128 --engine speculative=ngram   # a speculating engine's plain steps
    python -m bench.step.host_step --guided --replay --streams 128 --profile 40  # and where a step's time goes

The pipelined loop keeps the GPU fed only while plan + launch + commit of a step fit in the GPU's step. At 32
streams they took 0.58 ms a step on an H200 machine's host against a 0.79 ms GPU step
(bench/results/split_merge_floors/ab_plain_spec.json), and rounds with a slower host go host-bound. This times that
host work alone, on whatever CPU runs it: one engine per stream count (float32, CPU), every stream a chat prompt
decoding with EOS ignored; after --warmup-steps real steps, the runner's forward is replaced by nothing (the sampled
tokens stay what they were, so commit, detokenization and stop checks still run on real tokens), then --steps steps
timed in --rounds rounds. Per part, microseconds a step (medians over rounds): the engine's plan, launch and commit,
and inside plan the scheduler's schedule, the runner's prepare and the rows' `launched` bookkeeping; `period` is the
engine's step alone, `loop` the step with the admissions before it (`admit`: add_request of the requests that replace
finished ones, `admitted_per_step` of them; --stagger spreads the budgets over [M / 2, M] so that requests finish at
an even rate from the start). As in the
server's engine process, the heap is collected and frozen (gc.freeze) before the timed rounds, so a full collection
walks only what the load made since; each round's collections are recorded (`gc_ms_rounds`).

--guided: every request is constrained to one of --schemas' JSON schemas (its prompt asks for it) and replaced as it
finishes. There the model's layers are replaced by zeros and the sampler by each row's lowest allowed token, read
from its mask (what the sampler picks from zero logits), not the whole step: the grammar node fills the masks
(inline on the CPU), so every token is one the grammar accepts. Two more parts: the step's guided-row snapshot (in
plan) and its push to the grammar node (in launch, which here also holds the node's mask fill). Those outputs repeat
themselves far more than a model's, and the closers' guard and estimates work on what they repeat: --real-model
keeps the model (its forward then runs in launch and the period, so read the other parts); --replay records each
schema's output from the model once (greedy, before the timed steps) and replays it with the forward taken out, so
the closers and the guard see the model's own outputs at the host cost alone.
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import random
import statistics
import time
from contextlib import ExitStack
from pathlib import Path

from bench.common import (GcClock, engine_overrides, frozen_heap, markdown_table, note, record, stream_prompt,
                          write_results)
from bench.step.guided_load import (GUIDED_PROMPT_TOKENS, first_allowed_model, guided_work, record_outputs,
                                    replayed_model)

PROMPT_TOKENS = 64        # at most: the prompts are one short chat message
PARTS = ("plan", "schedule", "prepare", "launched", "launch", "commit", "period", "admit", "loop")
GUIDED_PARTS = ("snapshot", "push")


def parts(args) -> tuple:
    """The parts a run reports: PARTS, and GUIDED_PARTS with --guided."""
    return PARTS + (GUIDED_PARTS if args.guided else ())


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--warmup-steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=0,
                   help="agent-like load: requests of this many prompt tokens and --max-tokens new ones, each one "
                        "that finishes replaced at once (prefill chunks in the timed steps); 0: short prompts")
    p.add_argument("--max-tokens", type=int, default=32, help="with --prompt-tokens: new tokens a request")
    p.add_argument("--ids-only", action="store_true",
                   help="requests as the server's engine process adds them: token ids only (detokenize=False)")
    p.add_argument("--guided", action="store_true", help="JSON-schema requests of --max-tokens new tokens each")
    p.add_argument("--closing", action="store_true", help="--guided: outputs close at their budget (default: cut)")
    p.add_argument("--real-model", action="store_true",
                   help="--guided: the model's own outputs (its forward runs: time the parts, not the period)")
    p.add_argument("--replay", action="store_true",
                   help="--guided: the model's own outputs, recorded once (greedy, its forward) before the timed "
                        "steps and replayed there without the forward")
    p.add_argument("--schemas", default="tests/data/maskbench/JME_*.json", help="--guided: schema files (a glob)")
    p.add_argument("--stagger", action=argparse.BooleanOptionalAction, default=True,
                   help="replaced requests: budgets spread over [--max-tokens / 2, --max-tokens], so requests finish "
                        "and are replaced at an even rate (else the first ones all at once, after --max-tokens)")
    p.add_argument("--engine", nargs="*", default=[], metavar="KEY=VALUE",
                   help="EngineConfig fields, e.g. speculative=ngram (steps past spec_max_batch rows are plain)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="one more round under cProfile after the timed ones: its N functions of most own time")
    p.add_argument("--tag", default="", help="names the tree in the table (e.g. before / after)")
    p.add_argument("--out", default="bench/results/host_step.json")
    args = p.parse_args(argv)
    if min(args.streams) < 1 or args.steps < 1 or args.rounds < 1 or args.warmup_steps < 1 or args.max_tokens < 1:
        raise ValueError("--streams, --steps, --rounds, --warmup-steps and --max-tokens must be positive")
    if args.profile < 0:
        raise ValueError(f"--profile must be 0 (none) or more functions, got {args.profile}")
    if args.prompt_tokens < 0:
        raise ValueError(f"--prompt-tokens must be 0 or more, got {args.prompt_tokens}")
    if (args.real_model or args.replay) and not args.guided:
        raise ValueError("--real-model and --replay apply to --guided runs")
    if args.real_model and args.replay:
        raise ValueError("--real-model runs the forward, --replay replays its outputs: give one")
    if args.guided and args.prompt_tokens:
        raise ValueError("--guided requests have their schemas' prompts: --prompt-tokens does not apply")
    return args


def _timed(stack: ExitStack, owner, name: str, acc: dict, key: str) -> None:
    """Wrap owner.name in a timer adding its seconds to acc[key], undone when the stack closes."""
    fn = getattr(owner, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[key] += time.perf_counter() - t0

    undo = (setattr, owner, name, fn) if name in vars(owner) else (delattr, owner, name)    # a module's or its own
    setattr(owner, name, timed)
    stack.callback(*undo)


class Load:
    """The requests in flight: `streams` chat prompts decoding throughout, or requests replaced as they finish:
    (--prompt-tokens) of random prompt ids (no two share a prefix: no cache hits), (--guided) of JSON schemas."""

    def __init__(self, eng, args, streams: int, budget: int):
        from engine.requests.sequence import SamplingParams
        self.eng, self.args, self.streams, self.live, self.made = eng, args, streams, set(), 0
        self.loop = 0.0         # seconds in step(): admissions and the engine's step
        self.replaced = bool(args.prompt_tokens or args.guided)
        self.params = SamplingParams(max_tokens=args.max_tokens if self.replaced else budget, temperature=0,
                                     ignore_eos=True)
        self.work = guided_work(eng, args.schemas, args.max_tokens, args.closing) if args.guided else None

    def request(self) -> tuple[list[int], object]:
        if self.work:
            ids, params = self.work[self.made % len(self.work)]
            return ids, self._staggered(params)
        if self.args.prompt_tokens:
            rng = random.Random(self.made)
            return [rng.randrange(100, 20000) for _ in range(self.args.prompt_tokens)], self._staggered(self.params)
        ids = stream_prompt(self.eng, self.made)
        if len(ids) > PROMPT_TOKENS:
            raise ValueError(f"a prompt of {len(ids)} tokens: PROMPT_TOKENS is {PROMPT_TOKENS}")
        return ids, self.params

    def _staggered(self, params):
        """--stagger: the request's budget, one of [M / 2, M] for --max-tokens M, spread over the requests (a
        closing output needs room: M / 2, not 1)."""
        if not self.args.stagger:
            return params
        low = (params.max_tokens + 1) // 2
        return dataclasses.replace(params, max_tokens=low + self.made * 7919 % (params.max_tokens - low + 1))

    def step(self) -> None:
        """One engine step, and first the admission of requests to replace finished ones (add_request runs on
        the loop's thread before the step, as in the server's engine process). The requests are made before the
        clock starts: a prompt of random ids costs the bench more than its admission costs the engine."""
        wanted = self.streams - len(self.live)
        if not self.replaced:
            wanted = min(wanted, self.streams - self.made)
        requests = []
        for _ in range(max(wanted, 0)):
            requests.append(self.request())
            self.made += 1
        start = time.perf_counter()
        for ids, params in requests:
            self.live.add(self.eng.add_request(ids, params, detokenize=not self.args.ids_only))
        self._step()
        self.loop += time.perf_counter() - start

    def _step(self) -> None:
        for out in self.eng.step():
            if out.finished:
                if out.finish_reason == "error":        # a failing request would time its failure, not its steps
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                self.live.discard(out.request_id)


def measure(args, streams: int) -> dict:
    import engine.llm_engine as llm_engine
    from engine.llm_engine import LLMEngine
    from engine.config import EngineConfig
    budget = args.warmup_steps + args.rounds * args.steps + 8
    prompt = args.prompt_tokens or (GUIDED_PROMPT_TOKENS if args.guided else 0)
    per_request = prompt + args.max_tokens if prompt else budget + PROMPT_TOKENS
    pages = -(-per_request // EngineConfig.block_size) + 1      # every stream's pages, twice: no preemption
    kw = dict(device="cpu", dtype="float32", depth=2, max_num_seqs=streams, num_kv_blocks=2 * streams * pages + 8)
    eng = LLMEngine(**(kw | ({"model": args.model} if args.model else {}) | engine_overrides(args)))
    load = Load(eng, args, streams, budget)
    outputs = record_outputs(eng, load.work) if args.replay else None
    rounds = []
    with ExitStack() as stack:
        if args.replay:
            replayed_model(stack, eng, outputs)
        elif args.guided and not args.real_model:
            first_allowed_model(stack, eng)
        for _ in range(args.warmup_steps):
            load.step()
        stack.enter_context(frozen_heap())
        if not args.guided:
            eng.runner.program.step = lambda *a, **k: None      # the host around the forward is the subject
            stack.callback(delattr, eng.runner.program, "step")
        timers = [(eng.scheduler, "schedule", "schedule"), (eng.runner, "prepare", "prepare"),
                  (eng.scheduler, "launched", "launched"), (eng, "add_request", "admit")]
        if args.guided:
            timers += [(llm_engine, "build_snapshot", "snapshot"), (eng.runner.masks, "push", "push")]
        acc = dict.fromkeys((key for _, _, key in timers), 0.0)
        for owner, name, key in timers:
            _timed(stack, owner, name, acc, key)
        gc_ms = []
        for _ in range(args.rounds):
            eng.timings.reset()
            acc.update(dict.fromkeys(acc, 0.0))
            load.loop, made = 0.0, load.made
            with GcClock() as clock:
                for _ in range(args.steps):
                    load.step()
            gc_ms.append(clock.ms)
            ms = eng.timings.per_step_ms()
            n = max(eng.timings.steps, 1)
            rounds.append({k: 1e3 * ms[k] for k in ("plan", "launch", "commit", "period")}
                          | {k: 1e6 * v / n for k, v in acc.items()}
                          | {"loop": 1e6 * load.loop / args.steps, "admitted": (load.made - made) / args.steps})
        profile = profile_round(load, args.steps, args.profile) if args.profile else None
    if eng.scheduler.num_preemptions:
        raise RuntimeError(f"{eng.scheduler.num_preemptions} preemptions: the KV pages were sized to avoid them")
    eng.close()
    us = {k: statistics.median(r[k] for r in rounds) for k in parts(args)}
    admitted = statistics.median(r["admitted"] for r in rounds)
    return record("host_step", args.tag or "plain", eng.source.name, "float32", streams, None, None,
                  us["period"] / 1e3, tag=args.tag, steps=args.steps, rounds=args.rounds, us=us, us_rounds=rounds,
                  prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens if load.replaced else None,
                  ids_only=args.ids_only, guided=args.guided, requests=load.made, admitted_per_step=admitted,
                  stagger=args.stagger and load.replaced, engine=engine_overrides(args),
                  real_model=args.real_model, replay=args.replay, gc_ms_rounds=gc_ms,
                  recorded_tokens=[len(o) for o in outputs.values()] if outputs else None, profile=profile)


def profile_round(load, steps: int, top: int) -> list[dict]:
    """One more round of `steps` under cProfile: the `top` functions by their own time, microseconds a step
    (cProfile's overhead included: compare functions within a profile, not with the timed rounds)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        load.step()
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [dict(function=f"{Path(file).name}:{line}({name})", calls_per_step=calls / steps,
                 own_us=1e6 * own / steps, cumulative_us=1e6 * cum / steps)
            for (file, line, name), (_, calls, own, cum, _) in rows]


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    records = []
    for n in args.streams:
        records.append(measure(args, n))
        note(f"{args.tag or 'plain'} {n} streams: plan {records[-1]['us']['plan']:.1f} us, commit "
             f"{records[-1]['us']['commit']:.1f} us a step")
    write_results(records, args.out)
    rows = [dict(tag=r["tag"], streams=r["streams"], **r["us"]) for r in records]
    text = (f"Command: `{records[0]['command']}` on {records[0]['device']}, commit {records[0]['git_commit']}. "
            "Microseconds a step, medians over rounds.\n\n"
            + markdown_table(rows, ["tag", "streams", *parts(args)]))
    for r in records:
        if r["profile"]:
            text += (f"\n\ncProfile round, {r['streams']} streams (us a step, cProfile's overhead included):\n\n"
                     + markdown_table(r["profile"], ["function", "calls_per_step", "own_us", "cumulative_us"]))
    Path(str(args.out).rsplit(".", 1)[0] + ".md").write_text(text + "\n")
    print(text)
    return records


if __name__ == "__main__":
    main()
