"""GPU: guided decoding inside the captured step graphs (grammar branch with its host callback on the grammar
stream) against an eager torch-attention engine, pipelined and blocking; failures that stay with their request;
and a stress run of 32 guided rows for 1,000+ steps. Engines are shared per module (capture takes a while).

Run: pytest -q tests/guided/test_guided_gpu.py  ($SPECDEC_DATA: JSONSchemaBench schemas, else built-in ones only)
"""
import faulthandler
import json
import os
import random
from pathlib import Path

import pytest
import torch
import xgrammar as xgr

import hostfunc
from conftest import CHAT_PROMPTS, assert_no_leak
from engine.guided.masks import GrammarMasks
from engine.llm_engine import LLMEngine
from engine.requests.sequence import SamplingParams
from helpers import CAT, PRIMES, Exploding, allowed, drive_hooked, staggered, stepped_output

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
MODEL = os.environ.get("SPECDEC_MODEL", "default")
DATA = Path(os.environ.get("SPECDEC_DATA", Path(__file__).resolve().parents[2] / "../shared/data"))
BENCH = DATA / "jsonschemabench" / "maskbench"
JME = ["JME_45", "JME_38", "JME_7", "JME_17", "JME_91"]
# an overlapping oneOf xgrammar refuses: `auto` runs it on llguidance (in the grammar node, like xgrammar's rows)
ONE_OF = {"type": "object", "properties": {"shape": {"enum": ["circle", "rectangle"]}, "radius": {"type": "integer"},
                                           "length": {"type": "integer"}, "width": {"type": "integer"}},
          "required": ["shape"], "oneOf": [{"required": ["radius"]}, {"required": ["length", "width"]}]}
SKIP_FEATURES = ('"patternProperties"', '"if"', '"not"', '"uniqueItems"', '"dependencies"')


def _engine(**cfg):
    return LLMEngine(model=MODEL, device="cuda", max_model_len=1024, **({"max_num_seqs": 8} | cfg))


def _schemas() -> dict:
    if not BENCH.is_dir():
        return {}
    out = {}
    for path in sorted(BENCH.glob("JME_*.json")):
        text = json.dumps(json.loads(path.read_text())["schema"])
        if not any(f in text for f in SKIP_FEATURES):
            out[path.stem] = json.loads(text)
    return out


@pytest.fixture(scope="module")
def eager():
    """The reference: float32, torch attention, no graphs (its grammar callbacks are launched eagerly)."""
    eng = _engine(dtype="float32", attention_backend="torch", enforce_eager=True, num_kv_blocks=512)
    if eng.tokenizer is None:
        pytest.skip(f"{MODEL} has no tokenizer: no guided decoding")
    return eng


@pytest.fixture(scope="module")
def graphed(eager):
    """float32 Triton with every step in a captured graph, guided variants included; 32 rows."""
    eng = _engine(dtype="float32", attention_backend="triton", max_num_seqs=32, num_kv_blocks=4096)
    assert eng.runner.graphs is not None
    return eng


def ask(eng, text):
    return eng.apply_chat_template([{"role": "user", "content": text}])


@pytest.fixture(scope="module")
def prompts(eager):
    return [ask(eager, p) for p in CHAT_PROMPTS]


@pytest.fixture(scope="module")
def cases(eager, prompts):
    greedy = dict(max_tokens=48, temperature=0)
    schemas = _schemas()
    out = [(ask(eager, "Produce a JSON object that matches this schema: " + json.dumps(schemas[n])),
             SamplingParams(json_schema=schemas[n], **greedy)) for n in JME if n in schemas]
    return out + [(prompts[3], SamplingParams(json_schema=CAT, **greedy)),
                  (prompts[0], SamplingParams(max_tokens=48, temperature=0)),           # unguided, mixed in
                  (ask(eager, "Give me a US phone number."), SamplingParams(regex=r"\(\d{3}\) \d{3}-\d{4}", **greedy)),
                  (prompts[2], SamplingParams(ebnf=PRIMES, **greedy)),
                  (prompts[0], SamplingParams(choice=["Paris", "London", "Berlin"], **greedy)),
                  (prompts[3], SamplingParams(json_object=True, **greedy)),
                  (ask(eager, "Give me a small JSON object."),
                   SamplingParams(json_schema=ONE_OF, **greedy)),   # llguidance
                  (prompts[3], SamplingParams(json_schema=CAT, guided_backend="llguidance", **greedy))]


@pytest.fixture(scope="module")
def reference(eager, cases):
    seqs = eager.generate([p for p, _ in cases], [sp for _, sp in cases])
    assert all(s.error is None for s in seqs), [s.error for s in seqs]
    assert_no_leak(eager)
    return [s.output_token_ids for s in seqs]


def _tokens(eng, cases):
    return [s.output_token_ids for s in eng.generate([p for p, _ in cases], [sp for _, sp in cases])]


@pytest.mark.parametrize("depth", [1, 2])
def test_graphs_equal_the_eager_reference(graphed, cases, reference, depth):
    before = graphed.runner.graphs.replays["guided"]
    graphed.set_depth(depth)
    try:
        assert _tokens(graphed, cases) == reference
        for i in (0, len(cases) - 2):                                        # single requests too
            assert _tokens(graphed, [cases[i]]) == [reference[i]]
    finally:
        graphed.set_depth(2)
    assert graphed.runner.graphs.replays["guided"] > before
    assert_no_leak(graphed)


@pytest.mark.parametrize("depth", [1, 2])
def test_the_python_grammar_path_equals_the_native_node_on_cuda(cases, reference, depth):
    """The Python path (every step's masks through the matchers' Python API inside the CUDA callback, as a
    wrapper matcher takes it) gives the eager reference's tokens, blocking and pipelined."""
    eng = _engine(dtype="float32", attention_backend="torch", enforce_eager=True, num_kv_blocks=512,
                  grammar_node="python", depth=depth)
    try:
        seqs = eng.generate([p for p, _ in cases], [sp for _, sp in cases])
        assert [s.error for s in seqs] == [None] * len(seqs)
        assert [s.output_token_ids for s in seqs] == reference
        assert_no_leak(eng)
    finally:
        eng.close()


def test_seeded_sampling_is_the_same_pipelined_and_blocking(graphed, prompts):
    params = [SamplingParams(max_tokens=40, temperature=0.8, seed=s, json_schema=CAT) for s in range(6)]
    runs = []
    try:
        for depth in (1, 2):
            graphed.set_depth(depth)
            runs.append(_tokens(graphed, [(prompts[3], p) for p in params]))
    finally:
        graphed.set_depth(2)
    assert runs[0] == runs[1]
    assert len({tuple(t) for t in runs[1]}) > 1, "different seeds, different outputs"


def test_guided_graphs_capture_the_native_node_and_no_python(graphed, prompts, monkeypatch):
    graphs = graphed.runner.graphs
    guided = [key for key in graphs.graphs if key[2][0]]
    assert guided and not graphs.callbacks.handles, "the grammar node is native: no Python callback captured"
    python = []
    run = GrammarMasks.run_python
    monkeypatch.setattr(GrammarMasks, "run_python", lambda self: (python.append(1), run(self)))
    graphed.timings.reset()
    before = graphs.replays["guided"]
    seqs = graphed.generate([prompts[3]] * 2, [SamplingParams(max_tokens=32, temperature=0, json_object=True),
                                               SamplingParams(max_tokens=32, temperature=0, json_schema=ONE_OF)])
    assert [s.error for s in seqs] == [None, None] and seqs[1].params.guide.backend == "llguidance"
    assert graphed.timings.guided_steps > 0 and graphed.timings.callback > 0
    assert graphs.replays["guided"] > before and python == [], "replays ran the node, never the Python path"


def test_pipelined_matchers_accept_exactly_the_committed_tokens(graphed, eager, prompts):
    """Snapshots queue up on the host while callbacks run on the driver thread: each matcher must still see
    each committed token once, in order, and the queue must drain."""
    seqs, ref = drive_hooked(graphed, staggered(prompts)), drive_hooked(eager, staggered(prompts))
    greedy = [i for i, (_, _, sp) in enumerate(staggered(prompts)) if sp.temperature == 0]
    assert [seqs[i].output_token_ids for i in greedy] == [ref[i].output_token_ids for i in greedy]
    for seq in seqs:
        g, out = seq.guided, stepped_output(seq)
        if g is None:
            continue
        assert seq.error is None and len(out) - 1 <= g.accepted <= len(out), (g.accepted, len(out))
        fresh = xgr.GrammarMatcher(g.future.result())
        for token in out[:g.accepted]:
            assert fresh.is_terminated() or fresh.accept_token(token)
        assert fresh.is_terminated() == g.matcher.is_terminated()
        if not fresh.is_terminated():
            assert allowed(fresh, graphed.runner.vocab) == allowed(g.matcher, graphed.runner.vocab)
    assert not graphed.runner.masks.queue
    assert_no_leak(graphed)


def test_failing_guided_rows_fail_alone_inside_graphs(graphed, cases, reference, prompts):
    """An empty first mask, a dead end (the NO_TOKEN carried into the next graph), a bad grammar and a matcher
    that raises on the driver thread: each ends its request "error"; the rest give the reference tokens."""
    bad = [SamplingParams(max_tokens=8, temperature=0, ebnf=r"root ::= [^\x00-\U0010FFFF]"),
           SamplingParams(max_tokens=8, temperature=0.7, seed=1, ebnf=r'root ::= "a" [^\x00-\U0010FFFF]'),
           SamplingParams(max_tokens=8, json_schema={"$ref": "#/nope"}),
           SamplingParams(max_tokens=24, temperature=0, json_schema=CAT)]

    def arm(eng, ids):
        seq = eng._seqs.get(ids.get(len(cases) + 3, -1))
        if seq is not None and seq.guided.ready and not isinstance(seq.guided.matcher, Exploding):
            seq.guided.matcher = Exploding(seq.guided.matcher, 3)

    seqs = drive_hooked(graphed, [(0, p, sp) for p, sp in cases] + [(1, prompts[i], sp) for i, sp in enumerate(bad)],
                        arm)
    assert [s.output_token_ids for s in seqs[:len(cases)]] == reference
    errors = [s.error or "" for s in seqs[len(cases):]]
    assert [s.finish_reason for s in seqs[len(cases):]] == ["error"] * 4, errors
    assert "no token was allowed" in errors[0] and "no token was allowed" in errors[1], errors
    assert errors[2].startswith("invalid json_schema") and "matcher exploded" in errors[3], errors
    assert not hostfunc.take_errors()
    assert_no_leak(graphed)


@pytest.mark.timeout(300, method="thread")
def test_stress_32_guided_rows_for_1000_steps(graphed, prompts):
    """Requests of every guide kind keep 32 rows busy (a new one joins when one ends) for 1,000+ steps: no
    deadlock between the loop and the callbacks, every "stop" output valid, every page back."""
    try:
        import jsonschema
    except ImportError:                 # then "stop" outputs are only parsed
        jsonschema = None
    eng, rng = graphed, random.Random(0)
    if eng.guided.service is None:                      # built on the first guided request
        eng.guided.service = eng.guided._make()
    svc = eng.guided.service
    pool = []
    for s in list(_schemas().values()) + [CAT, ONE_OF]:
        prompt = ask(eng, "Produce a JSON object that matches this schema: " + json.dumps(s))
        try:
            svc.compile_now(SamplingParams(json_schema=s).guide)
        except Exception:               # noqa: BLE001 - a schema xgrammar cannot take is not this test's subject
            continue
        if len(prompt) <= 640:
            pool.append((prompt, dict(json_schema=s), s))
    pool += [(prompts[3], dict(json_object=True), {"type": "object"}), (prompts[2], dict(ebnf=PRIMES), None)]
    eng.timings.reset(trace=True)
    checks, finals = {}, []
    faulthandler.dump_traceback_later(330, exit=True)     # a deadlock without pytest-timeout: stacks, then exit
    try:
        while eng.timings.steps < 1000 or eng.has_unfinished():
            while eng.timings.steps < 1000 and eng.num_live_requests() < 32:
                prompt, guide, s = rng.choice(pool)
                sampling = dict(temperature=0.8, seed=rng.randrange(2 ** 31)) if rng.random() < 0.5 else {}
                params = SamplingParams(max_tokens=128, **(dict(temperature=0) | sampling | guide))
                checks[eng.add_request(prompt, params)] = s
            finals += [(out, checks.pop(out.request_id)) for out in eng.step() if out.finished]
        trace = eng.timings.trace
    finally:
        faulthandler.cancel_dump_traceback_later()
        eng.timings.trace = None
    assert len(trace) >= 1000 and max(t["rows"] for t in trace) == 32
    assert sum(t["guided_steps"] for t in trace) >= 950, "nearly every step has guided rows"
    assert not checks and len(finals) >= 64
    stopped = 0
    for out, s in finals:
        assert out.error is None and out.finish_reason in ("stop", "length"), out.error
        if out.finish_reason == "stop" and s is not None:
            value = json.loads(out.text)
            if jsonschema is not None:
                jsonschema.validate(value, s)
            stopped += 1
    assert stopped >= max(8, len(finals) // 10), f"only {stopped} of {len(finals)} outputs ended on their own"
    assert not eng.runner.masks.queue and not hostfunc.take_errors()
    assert_no_leak(eng)
