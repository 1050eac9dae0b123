"""Where a decode step's host launch goes: the launch's parts per step, and their spread, unprofiled.

    python -m bench.step.launch_parts                          # default model, 1 and 32 streams, 200 steps
    python -m bench.step.launch_parts --streams 1 --runtime    # also the CUDA runtime calls of the launches
    python -m bench.step.launch_parts --engine native_launch=false  # the Python launch's parts
    python -m bench.step.launch_parts --device cpu --dtype float32 --streams 1 --steps 4 --out /tmp/l.json  # smoke

With the Python launch, at one stream the default model's host launch (engine timings' `launch`) was about half
its step, while the graph replay inside it (`replay`) was a tenth of the launch, and a bare replay costs ~5 us
whatever the kernel count (bench/step/graph_launch.py). This times the rest. Per stream count: one engine, every
stream a chat prompt decoding with EOS ignored; after --warmup-steps, --steps steps with the runner's launch and
its parts wrapped in host timers (a part called inside another counts for the outer one):

    upload    the step inputs' copy to the device (DecodeSlot.upload)
    forward   the step graph's replay, or the eager forward where a step has no graph
    download  the sampled tokens' copy to the host (DecodeSlot.download_sampled)
    events    CUDA event records and stream waits (torch.cuda.Event.record, torch.cuda.Stream.wait_event)
    native    the one native call that makes all of the above for graph steps (native_launch, on by default)
    rest      the launch less its parts: stream switches, the grammar snapshot's push, Python

Each part's median, p90, max and mean microseconds a launch, so a mean carried by a few slow launches shows
as a mean far over the median. `--runtime`: then --steps more steps under torch.profiler's CPU activity, and
the CUDA runtime calls inside them (cudaGraphLaunch, cudaMemcpyAsync, cudaEventRecord, ...) by name: calls
and microseconds a step, and the slowest call (the profiler slows every call a little).
"""
from __future__ import annotations

import argparse
import statistics
import time
from contextlib import ExitStack
from pathlib import Path

from bench.common import markdown_table, note, record, stream_prompt, write_results
from bench.step.throughput import build_engine

PARTS = ("upload", "forward", "download", "events", "native", "rest")
STATS = ("median", "p90", "max", "mean")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--engine", nargs="*", default=[], metavar="KEY=VALUE", help="further EngineConfig fields")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--runtime", action="store_true", help="also the CUDA runtime calls, under the profiler")
    p.add_argument("--out", default="bench/results/launch_parts.json")
    args = p.parse_args(argv)
    if min(args.streams) < 1 or args.steps < 1 or args.warmup_steps < 0:
        raise ValueError(f"--streams and --steps must be positive, --warmup-steps not negative: {args.streams}, "
                         f"{args.steps}, {args.warmup_steps}")
    return args


class LaunchProbe:
    """Host timers around the runner's launch and its parts while entered; `launches`: one dict of seconds a
    launch (`total` and PARTS). Only the outermost timed part of a call chain is charged."""

    def __init__(self, runner, clock=time.perf_counter):
        self.runner, self.clock, self.launches, self._cur, self._inside = runner, clock, [], None, False

    def __enter__(self):
        import torch
        from engine.runner.slots import DecodeSlot
        self._stack = ExitStack()
        targets = [(DecodeSlot, "upload", "upload"), (DecodeSlot, "download_sampled", "download"),
                   (self.runner.program, "step", "forward")]
        if self.runner.graphs is not None:      # None where steps run eagerly (the CPU, --enforce-eager)
            targets.append((self.runner.graphs, "replay", "forward"))
        if getattr(self.runner, "native", None) is not None:    # native_launch: the one native call
            targets.append((self.runner.native, "launch", "native"))
        if torch.cuda.is_available():
            targets += [(torch.cuda.Event, "record", "events"), (torch.cuda.Stream, "wait_event", "events")]
        for owner, name, part in targets:
            self._patch(owner, name, self._part(part, getattr(owner, name)))
        self._patch(self.runner, "launch", self._launch(self.runner.launch))
        return self

    def __exit__(self, *exc):
        self._stack.close()

    def _patch(self, owner, name, fn):
        saved = owner.__dict__[name] if name in vars(owner) else None
        setattr(owner, name, fn)
        self._stack.callback(lambda: setattr(owner, name, saved) if saved is not None else delattr(owner, name))

    def _part(self, part, fn):
        def timed(*args, **kwargs):
            if self._cur is None or self._inside:
                return fn(*args, **kwargs)
            self._inside, t0 = True, self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self._cur[part] += self.clock() - t0
                self._inside = False
        return timed

    def _launch(self, fn):
        def timed(*args, **kwargs):
            self._cur, t0 = dict.fromkeys(PARTS, 0.0), self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                cur, self._cur = self._cur, None
                cur["total"] = self.clock() - t0
                cur["rest"] = cur["total"] - sum(cur[p] for p in PARTS if p != "rest")
                self.launches.append(cur)
        return timed


def spread(seconds: list[float]) -> dict:
    """{median, p90, max, mean} in microseconds."""
    us = sorted(1e6 * s for s in seconds)
    return dict(median=statistics.median(us), p90=us[min(len(us) - 1, int(0.9 * len(us)))], max=us[-1],
                mean=statistics.fmean(us))


def runtime_calls(eng, steps: int) -> dict:
    """{CUDA runtime call: calls / us a step, slowest us} over `steps` steps under the profiler's CPU activity."""
    import torch
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    calls: dict[str, list] = {}
    for e in prof.events():
        if e.name.startswith("cuda"):
            calls.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    return {name: dict(per_step=len(us) / steps, us_per_step=sum(us) / steps, max_us=max(us))
            for name, us in sorted(calls.items(), key=lambda kv: -sum(kv[1]))}


def measure(args, streams: int) -> dict:
    import torch
    from engine.requests.sequence import SamplingParams
    eng = build_engine(args, 2, streams)
    budget = args.warmup_steps + args.steps * (2 if args.runtime else 1) + 8
    for i in range(streams):
        eng.add_request(stream_prompt(eng, i), SamplingParams(max_tokens=budget, temperature=0, ignore_eos=True))
    for _ in range(args.warmup_steps):
        eng.step()
    periods = []
    with LaunchProbe(eng.runner) as probe:
        for _ in range(args.steps):
            t0 = time.perf_counter()
            eng.step()
            periods.append(time.perf_counter() - t0)
    if not probe.launches:
        raise RuntimeError("no step was launched: every request finished before the timed steps")
    parts = {p: spread([launch[p] for launch in probe.launches]) for p in ("total", *PARTS)}
    extra = dict(runtime=runtime_calls(eng, args.steps)) if args.runtime and torch.cuda.is_available() else {}
    rec = record("launch_parts", "plain", eng.source.name, args.dtype, streams, None, None,
                 1e3 * statistics.fmean(periods), launches=len(probe.launches), step_us=spread(periods),
                 launch_us=parts, **extra)
    eng.close()
    return rec


def rows(records: list[dict]) -> list[dict]:
    """One table row per (streams, part): its spread a launch in us."""
    out = [dict(streams=r["streams"], part="step", **r["step_us"]) for r in records]
    out += [dict(streams=r["streams"], part=p, **r["launch_us"][p]) for r in records for p in ("total", *PARTS)]
    return sorted(out, key=lambda row: row["streams"])


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    records = []
    for n in args.streams:
        records.append(measure(args, n))
        launch = records[-1]["launch_us"]["total"]
        note(f"{n} streams: launch median {launch['median']:.1f} us, mean {launch['mean']:.1f} us")
    write_results(records, args.out)
    text = (f"Command: `{records[0]['command']}` on {records[0]['device']}, commit {records[0]['git_commit']}. "
            "Microseconds a launch (step: a whole engine step).\n\n" + markdown_table(rows(records),
                                                                                     ["streams", "part", *STATS]))
    for r in records:
        if r.get("runtime"):
            calls = [dict(call=k, **v) for k, v in r["runtime"].items()]
            text += (f"\n\n{r['streams']} streams, CUDA runtime calls under the profiler:\n\n"
                     + markdown_table(calls, ["call", "per_step", "us_per_step", "max_us"]))
    Path(str(args.out).rsplit(".", 1)[0] + ".md").write_text(text + "\n")
    print(text)
    return records


if __name__ == "__main__":
    main()
