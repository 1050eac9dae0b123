"""What several test modules share: engine settings, workloads, loop drivers and grammar probes. Fixtures built
from these live in conftest.py; test modules import from here, never from each other."""
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from engine.guided.compiler import GrammarService
from engine.requests.sequence import SamplingParams
from engine.runner.graphs import StepGraphs

CPU = dict(device="cpu", dtype="float32", attention_backend="torch")
# Engines on the Triton backend without CUDA run every kernel in the interpreter; there no route is measured, so
# every matmul is cuBLAS's unless a test pins one (engine/kernels/routes.py). With CUDA they keep the default.
INTERPRETER_SETTINGS = {}
# (drafter, depth) of the kernels' engine tests: all four with CUDA; in the interpreter each costs ~half a minute,
# so there one depth a drafter (each drafter and each depth still run)
SPEC_DEPTHS = [("eagle", 2), ("ngram", 1)] + ([("eagle", 1), ("ngram", 2)] if torch.cuda.is_available() else [])
ROOMY, PREEMPTING = dict(), dict(num_kv_blocks=6, max_num_batched_tokens=64)

# ---- guides ---------------------------------------------------------------------------------------------------
CAT = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
       "required": ["name", "age"]}
WORDS = "(one|two|three|four|five|six|seven|eight|nine|ten)"
PRIMES = 'root ::= [0-9]+ (", " [0-9]+)* "."'
UNGUIDED = SamplingParams(max_tokens=12, temperature=0)
WEATHER = json.loads((Path(__file__).resolve().parents[1] / "docs/examples/get_weather.schema.json").read_text())
PEOPLE = {"type": "object", "properties": {"people": {"type": "array", "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"]}}}, "required": ["people"]}

# ---- prompts --------------------------------------------------------------------------------------------------
EXTRA_PROMPTS = ["Name a color.", "Count from one to ten in words.", "What does a tool call look like in JSON?"]
REPEATING = ["List the numbers from 1 to 30 separated by spaces.",
             'Copy this JSON exactly: {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}']
ASK = ["Call get_weather for Paris in celsius.", "List three people with their names and ages as JSON.",
       "What is the phone number of the pizza place?", "List the numbers from 1 to 20 separated by spaces.",
       "Is the sky blue? Answer yes or no.", "Give me the weather in Oslo as a tool call."]


# ---- workloads: (arrival step, prompt ids, params) per request --------------------------------------------------
def pipeline_workload(prompts, stop_word, stop_token):
    """Every way a request can end (EOS, length, stop string, stop token, at prefill), late arrivals and a seeded
    sampled request."""
    greedy = dict(temperature=0.0)
    return [
        (0, prompts[0], SamplingParams(max_tokens=32, **greedy)),                        # EOS
        (0, prompts[1], SamplingParams(max_tokens=7, **greedy)),                         # length
        (0, prompts[2], SamplingParams(max_tokens=24, stop=[stop_word], **greedy)),      # stop string
        (3, prompts[3], SamplingParams(max_tokens=16, stop_token_ids=[stop_token], **greedy)),
        (3, prompts[4], SamplingParams(max_tokens=1, **greedy)),                         # ends at prefill
        (5, prompts[5], SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7)),
        (9, prompts[6], SamplingParams(max_tokens=16, ignore_eos=True, **greedy)),
        (12, prompts[7], SamplingParams(max_tokens=12, **greedy)),
    ]


def guided_workload(engine):
    """JSON schemas, a regex, a choice, an unguided row, a late guided arrival and a seeded sampled guided row
    (checked for validity only: speculative sampling draws other tokens)."""
    p = [engine.apply_chat_template([{"role": "user", "content": a}]) for a in ASK]
    greedy = dict(temperature=0.0)
    return [(0, p[0], SamplingParams(max_tokens=40, json_schema=WEATHER, **greedy)),
            (0, p[1], SamplingParams(max_tokens=48, json_schema=PEOPLE, **greedy)),
            (0, p[2], SamplingParams(max_tokens=16, regex=r"\(\d{3}\) \d{3}-\d{4}", **greedy)),
            (0, p[3], SamplingParams(max_tokens=24, **greedy)),
            (1, p[0], SamplingParams(max_tokens=40, json_schema=WEATHER, temperature=0.8, seed=5)),
            (2, p[4], SamplingParams(max_tokens=8, choice=["yes", "no"], **greedy)),
            (3, p[5], SamplingParams(max_tokens=40, json_schema=WEATHER, **greedy))]     # in arrival order


def staggered(prompts):
    """Guided requests of every kind (and one unguided) arriving at different steps, ending differently."""
    cities = ["Paris", "London", "Berlin", "Rome"]
    return [(0, prompts[0], SamplingParams(max_tokens=8, temperature=0, choice=cities)),
            (0, prompts[3], SamplingParams(max_tokens=32, temperature=0, json_schema=CAT)),
            (1, prompts[4], UNGUIDED),
            (2, prompts[1], SamplingParams(max_tokens=10, temperature=0, regex="[a-z ]+")),
            (4, prompts[2], SamplingParams(max_tokens=24, temperature=0, ebnf=PRIMES)),
            (6, prompts[4], SamplingParams(max_tokens=12, temperature=0.8, seed=3, regex=f"{WORDS}( {WORDS})*",
                                           close_at_budget=False)),     # cut by its budget
            (7, prompts[0], SamplingParams(max_tokens=16, temperature=0, json_object=True))]


# ---- driving the loop -----------------------------------------------------------------------------------------
def drive(eng, workload):
    """Add each (arrival step, prompt, params) at its step and step the engine until every request ends;
    returns the finished Sequences in workload order. Checks every step that no row is held by more than
    two steps in flight."""
    ids, step = {}, 0
    pending = sorted(workload, key=lambda w: w[0])
    while pending or eng.has_unfinished():
        while pending and pending[0][0] <= step:
            _, prompt, params = pending.pop(0)
            ids[eng.add_request(prompt, params, retain=True)] = len(ids)
        eng.step()
        step += 1
        assert all(0 <= s.inflight_refs <= 2 for s in eng._seqs.values())
    return [eng.take(i) for i in sorted(ids, key=ids.get)]


def drive_hooked(engine, requests, hook=None):
    """requests: (arrival step, prompt, params). Runs to the end, calling hook(engine, {index: request id})
    after each step; returns the retained Sequences in order."""
    pending, ids, step = sorted(enumerate(requests), key=lambda r: r[1][0]), {}, 0
    while pending or engine.has_unfinished():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, params) = pending.pop(0)
            ids[i] = engine.add_request(prompt, params, retain=True)
        engine.step()
        if hook:
            hook(engine, ids)
        step += 1
    return [engine.take(ids[i]) for i in range(len(requests))]


def build_fake_libcuda(directory) -> str | None:
    """Build hostfunc/testing/fake_libcuda.c as `directory`/libcuda.so.1; returns the directory, None where no C
    compiler or source is there (tests skip)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    source = Path(__file__).resolve().parents[1] / "hostfunc" / "testing" / "fake_libcuda.c"
    if compiler is None or not source.exists():
        return None
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(Path(directory) / "libcuda.so.1"), str(source),
                    "-lpthread"], check=True, timeout=120)
    return str(directory)


def run_fake_driver_scenario(directory, module: str) -> subprocess.CompletedProcess:
    """Run `python -m module` from the repository with the fake libcuda of `directory` first on the loader's path."""
    env = dict(os.environ, LD_LIBRARY_PATH=f"{directory}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    return subprocess.run([sys.executable, "-m", module], env=env, cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=60)


class EagerGraphs(StepGraphs):
    """The graphs' padded step layouts (guided variants too if `guided`), run eagerly: what a replay
    computes, on any device."""
    def __init__(self, runner, guided: bool = False):
        super().__init__(runner.config, runner.max_model_len, guided=guided, spec_rows=runner.spec_rows)
        self.runner = runner

    def replay(self, slot, variant) -> float:
        self.replays[slot.graph_key.kind] += 1
        self.replays["guided"] += variant.guided
        prev, t0 = self.runner.slots[1 - slot.index], time.perf_counter()
        self.runner.program.step(slot, prev, variant, slot.graph_key)
        return time.perf_counter() - t0


# ---- speculative decoding ------------------------------------------------------------------------------------
def record_drafts(drafter) -> list:
    """The list the drafter's proposals go into from now on, in order (its propose wrapped)."""
    drafts, propose = [], drafter.propose
    drafter.propose = lambda ctx: drafts.append(propose(ctx)) or drafts[-1]
    return drafts


def record_steps(eng) -> list:
    """The list (K, quiet, drafted) of every step the engine runs goes into from now on, in launch order."""
    program, log = eng.runner.program, []
    proposals, step = record_drafts(program.drafter), program.step

    def recorded(slot, prev, variant, key=None):
        before = len(proposals)
        step(slot, prev, variant, key)
        log.append((slot.spec_k, slot.quiet if key is None else not key.drafts, len(proposals) > before))
    program.step = recorded
    return log


def greedy_drafts(eng, prompts, lengths) -> tuple[list, list]:
    """(outputs, each proposal's draft tokens as lists) of greedy requests of max_tokens `lengths`, EOS ignored."""
    drafts = record_drafts(eng.runner.program.drafter)
    seqs = eng.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths])
    return [s.output_token_ids for s in seqs], [d.draft_tokens.tolist() for d in drafts]


def random_eagle_head(cfg, seed=3):
    """A random EAGLE head for target config `cfg` reading layers (0, 1, 2), its weights scaled so that its drafts
    vary."""
    from dataclasses import replace
    from engine.speculative.eagle_head import EagleHead, HeadConfig
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = EagleHead(replace(HeadConfig.for_target(cfg), feature_layers=(0, 1, 2))).requires_grad_(False)
    for p in head.parameters():
        if p.dim() == 2:
            p.mul_(4.0)
    return head


def eagle_target(monkeypatch, directory) -> str:
    """Registers the dummy target "tiny3" (three layers) and saves a random_eagle_head for it in `directory`
    (EngineConfig.spec_head's layout); returns that directory."""
    from safetensors.torch import save_file
    from engine.models import loader
    cfg = dict(loader._TINY, num_hidden_layers=3)
    monkeypatch.setitem(loader.DUMMY_SHAPES, "tiny3", cfg)
    head = random_eagle_head(cfg)
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(Path(directory) / "head.safetensors"))
    (Path(directory) / "head.json").write_text(json.dumps(head.cfg.to_dict()))
    return str(directory)


# ---- grammars -------------------------------------------------------------------------------------------------
def service(engine) -> GrammarService:
    if engine.guided.service is None:                  # built on the first guided request
        engine.guided.service = engine.guided._make()
    return engine.guided.service


def allowed(matcher, vocab) -> set:
    bitmask = torch.zeros((1, math.ceil(vocab / 32)), dtype=torch.int32)
    matcher.fill_next_token_bitmask(bitmask, 0)
    bits = ((bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
    return set(bits.nonzero().flatten().tolist())


class Exploding:
    """A matcher whose accept_token raises after `n` tokens (everything else is the real matcher's)."""
    def __init__(self, matcher, n):
        self._matcher, self._left = matcher, n

    def accept_token(self, token):
        if self._left == 0:
            raise RuntimeError("matcher exploded")
        self._left -= 1
        return self._matcher.accept_token(token)

    def __getattr__(self, name):
        return getattr(self._matcher, name)


def stepped_output(seq) -> list[int]:
    """A guided request's output up to a closing that ended it (engine/guided/closing.py): with no logprobs asked
    for, the host commits such a closing whole, and no matcher of the grammar node sees it."""
    closer = seq.closer
    if seq.closed_by is not None and closer.forced and closer.forced[-1] == closer.vocab.stop:
        return seq.output_token_ids[:closer.start]
    return seq.output_token_ids
