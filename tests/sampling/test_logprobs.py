"""Logprobs (engine/sampling/logprobs.py): every output token's entry equals torch.log_softmax of the simple path's
logits (one prefill of the prompt and the outputs, conftest.prefill_logits, scores every output token), grammar-masked
for guided requests, for plain greedy and sampled rows, guided rows and n-gram speculation; the pipelined loop, the
graphs' padded layouts and preemption give the blocking loop's numbers."""
import math

import pytest
import torch
import xgrammar as xgr

from conftest import assert_no_leak, prefill_logits
from engine.guided.compiler import compile_guide
from engine.llm_engine import LLMEngine
from engine.sampling.limits import MAX_LOGPROBS
from engine.requests.sequence import SamplingParams
from engine.requests.validation import check_request
from helpers import CAT, CPU, PREEMPTING, REPEATING, EagerGraphs, allowed, drive

TOL = 2e-3


def reference(engine, prompt, out, guide=None):
    """Per output token: log_softmax of the simple path's logits (masked by the guide's grammar, if any)."""
    matcher = None
    if guide is not None:
        service = engine.guided.service or engine.guided._make()
        engine.guided.service = service
        matcher = xgr.GrammarMatcher(compile_guide(service.compiler, guide))
    refs, scores = [], prefill_logits(engine, prompt + out[:-1], last=len(out)) if out else []
    for token, logits in zip(out, scores):
        if matcher is not None:
            keep = torch.zeros_like(logits, dtype=torch.bool)
            keep[sorted(allowed(matcher, engine.runner.vocab))] = True
            logits = logits.masked_fill(~keep, -math.inf)
            assert matcher.accept_token(token)
        refs.append(torch.log_softmax(logits, dim=-1))
    return refs


def check(engine, prompt, seq, guide=None):
    n = seq.params.logprobs
    assert len(seq.logprobs) == len(seq.output_token_ids)
    for token, (lp, top), ref in zip(seq.output_token_ids, seq.logprobs,
                                     reference(engine, prompt, seq.output_token_ids, guide)):
        assert lp == pytest.approx(ref[token].item(), abs=TOL)
        finite = int(torch.isfinite(ref).sum())
        assert len(top) == min(n, finite)
        assert [v for _, v in top] == pytest.approx(ref.topk(len(top)).values.tolist(), abs=TOL)
        for tid, v in top:
            assert v == pytest.approx(ref[tid].item(), abs=TOL)
        assert all(a >= b for (_, a), (_, b) in zip(top, top[1:]))


def flat(entries):
    """(token ids, numbers) of a list of entries, for exact and approximate comparison."""
    ids = [t for _, top in entries for t, _ in top]
    return ids, [v for lp, top in entries for v in (lp, *(x for _, x in top))]


def ask(engine, text):
    return engine.apply_chat_template([{"role": "user", "content": text}])


@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, True, 1.5, "3"])
def test_bad_logprobs_raise_naming_the_field(value):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=value)


def test_an_engine_without_logprobs_refuses_them(engine):
    with pytest.raises(ValueError, match="logprobs"):
        check_request([1, 2], SamplingParams(logprobs=0), engine.runner.vocab, 100, engine.blocks,
                      has_tokenizer=True, logprobs=False)


def test_plain_greedy_and_sampled_rows_equal_the_simple_path(engine, chat_prompts):
    params = [SamplingParams(max_tokens=6, temperature=0, logprobs=5),
              SamplingParams(max_tokens=6, temperature=0.9, top_p=0.8, top_k=50, seed=3, logprobs=MAX_LOGPROBS),
              SamplingParams(max_tokens=6, temperature=0, logprobs=0),
              SamplingParams(max_tokens=6, temperature=0)]
    prompts = chat_prompts[:4]
    seqs = engine.generate(prompts, params)
    for prompt, seq in zip(prompts[:3], seqs[:3]):
        check(engine, prompt, seq)
    assert all(top == [] for _, top in seqs[2].logprobs)
    assert seqs[3].logprobs is None
    assert_no_leak(engine)


def test_streamed_outputs_carry_each_tokens_entry(engine, chat_prompts):
    params = SamplingParams(max_tokens=5, temperature=0, logprobs=2)
    outs = list(engine.stream(chat_prompts[0], params))
    assert all(len(o.logprobs) == len(o.new_token_ids) for o in outs)
    [seq] = engine.generate([chat_prompts[0]], params)
    streamed = flat([e for o in outs for e in o.logprobs])
    assert streamed[0] == flat(seq.logprobs)[0] and streamed[1] == pytest.approx(flat(seq.logprobs)[1], abs=1e-4)
    assert next(iter(engine.stream(chat_prompts[0], SamplingParams(max_tokens=2)))).logprobs is None


def test_guided_rows_are_masked_logprobs(engine, chat_prompts):
    params = SamplingParams(max_tokens=12, temperature=0, json_schema=CAT, logprobs=4)
    seqs = engine.generate([chat_prompts[3], chat_prompts[0]], [params, SamplingParams(max_tokens=4, temperature=0.7,
                                                                                          logprobs=1)])
    check(engine, chat_prompts[3], seqs[0], params.guide)
    check(engine, chat_prompts[0], seqs[1])


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_ngram_speculation_logprobs_are_the_targets(engine, temperature):
    """Every emitted token (accepted drafts, the correction, the bonus token) has the target's logprob there."""
    prompts = [ask(engine, text) for text in REPEATING]
    eng = LLMEngine(**CPU, speculative="ngram", num_speculative_tokens=2, spec_min_acceptance=0.0)
    params = SamplingParams(max_tokens=24, temperature=temperature, seed=5, ignore_eos=True, logprobs=3)
    seqs = eng.generate(prompts, params)
    assert eng.timings.spec_accepted > 0
    for prompt, seq in zip(prompts, seqs):
        check(engine, prompt, seq)
    assert_no_leak(eng)


def _workload(engine, chat_prompts):
    return [(0, chat_prompts[0], SamplingParams(max_tokens=10, temperature=0, logprobs=3)),
            (0, chat_prompts[1], SamplingParams(max_tokens=10, temperature=0)),
            (2, chat_prompts[2], SamplingParams(max_tokens=12, temperature=0.8, seed=9, logprobs=2)),
            (3, chat_prompts[3], SamplingParams(max_tokens=12, temperature=0, json_schema=CAT, logprobs=1)),
            (4, ask(engine, REPEATING[0]), SamplingParams(max_tokens=12, temperature=0, logprobs=0))]


def _same(got, ref):
    assert [s.output_token_ids for s in got] == [s.output_token_ids for s in ref]
    for a, b in zip(got, ref):
        assert (a.logprobs is None) == (b.logprobs is None)
        if a.logprobs is not None:
            (ids_a, vals_a), (ids_b, vals_b) = flat(a.logprobs), flat(b.logprobs)
            assert ids_a == ids_b and vals_a == pytest.approx(vals_b, abs=1e-4)


@pytest.mark.parametrize("cfg", [{}, dict(speculative="ngram", num_speculative_tokens=2)], ids=["plain", "ngram"])
def test_pipelined_graph_layout_and_preemption_equal_blocking(engine, chat_prompts, cfg):
    workload = _workload(engine, chat_prompts)
    ref = drive(LLMEngine(**CPU, depth=1, **cfg), workload)
    for depth, graphs, extra in ((2, True, {}), (2, False, PREEMPTING)):    # the padded layouts run the pipelined loop
        eng = LLMEngine(**CPU, depth=depth, **cfg, **extra)
        if graphs:
            eng.runner.graphs = EagerGraphs(eng.runner, guided=True)
        _same(drive(eng, workload), ref)
        assert_no_leak(eng)
        if extra:
            assert eng.scheduler.num_preemptions > 0


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [{}, dict(speculative="ngram", num_speculative_tokens=2)], ids=["plain", "ngram"])
def test_gpu_graphs_logprobs_equal_eager(engine, chat_prompts, cfg):
    gpu = dict(device="cuda", dtype="float32", attention_backend="triton", max_model_len=1024)
    workload = _workload(engine, chat_prompts)
    ref = drive(LLMEngine(**gpu, enforce_eager=True, **cfg), workload)
    eng = LLMEngine(**gpu, debug_sync=True, **cfg)
    _same(drive(eng, workload), ref)
    assert eng.runner.graphs.replays["decode" if not cfg else "spec"] > 0
    assert_no_leak(eng)


def test_prompt_logprobs_are_the_prompts_log_softmax(engine, chat_prompts, monkeypatch):
    """vLLM's prompt_logprobs (engine/sampling/prompt_logprobs.py), its forward in chunks of 7 tokens."""
    import engine.sampling.prompt_logprobs as scoring
    monkeypatch.setattr(scoring, "CHUNK", 7)
    prompt = chat_prompts[2]
    outs = list(engine.stream(prompt, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)))
    entries = outs[-1].prompt_logprobs
    assert all(o.prompt_logprobs is None for o in outs[:-1]) and len(entries) == len(prompt) - 1
    ref = torch.log_softmax(prefill_logits(engine, prompt, last=len(prompt))[:-1], dim=-1)
    for i, (token, logprob, rank, top) in enumerate(entries):
        assert token == prompt[i + 1] and logprob == pytest.approx(ref[i, token].item(), abs=TOL)
        assert rank == int((ref[i] > ref[i, token] + TOL).sum()) + 1 or rank == int((ref[i] > ref[i, token]).sum()) + 1
        best = ref[i].topk(3)
        assert [t for t, _ in top] == best.indices.tolist(), i
        assert [v for _, v in top] == pytest.approx(best.values.tolist(), abs=TOL)
    assert next(iter(engine.stream(prompt, SamplingParams(max_tokens=1)))).prompt_logprobs is None
    assert_no_leak(engine)
