"""Penalties, logit_bias, min_p and min_tokens (engine/sampling/penalties.py) equal a plain reference over the full
token history on the simple path's logits (conftest.prefill_logits) for greedy and seeded sampled rows; the pipelined
loop, the graphs' padded layouts, preemption and a speculating engine give the blocking loop's tokens."""
import pytest
import torch

from conftest import assert_no_leak, prefill_logits
from engine.llm_engine import LLMEngine
from engine.sampling.sampler import sample
from engine.requests.sequence import SamplingParams
from helpers import CPU, PREEMPTING, REPEATING, EagerGraphs, drive


def penalized(logits, prompt, out, p):
    """The spec in a few lines: repetition over prompt + output, then frequency and presence over the output."""
    counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).float() if out \
        else torch.zeros_like(logits)
    seen = counts > 0
    seen[torch.tensor(prompt)] = True
    logits = torch.where(seen, torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty),
                         logits)
    logits = logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
    for token, bias in p.logit_bias or ():
        logits[token] += bias
    return logits


def reference_tokens(engine, prompt, p, out):
    """For each position i of `out`: the token the spec draws after prompt + out[:i] and its logprob. Teacher-forced
    (one prefill scores every position): the same token at every position means the same sequence."""
    scores = prefill_logits(engine, prompt + out[:-1], last=len(out)) if out else []
    for i, raw in enumerate(scores):
        logits = penalized(raw.clone(), prompt, out[:i], p)
        if i < p.min_tokens:
            logits[sorted(engine.eos_ids | set(p.stop_token_ids))] = float("-inf")
        lp = torch.log_softmax(logits, -1)
        token = sample(logits[None].clone(), torch.tensor([p.temperature]), torch.tensor([p.top_k]),
                       torch.tensor([p.top_p]), torch.tensor([p.seed or 0]), torch.tensor([i]),
                       min_p=torch.tensor([p.min_p]))[0].item()
        yield token, lp[token].item()


CASES = [dict(presence_penalty=1.5, temperature=0), dict(frequency_penalty=1.0, presence_penalty=0.5, temperature=0),
         dict(repetition_penalty=1.3, temperature=0), dict(repetition_penalty=0.8, temperature=0),
         dict(repetition_penalty=1.2, frequency_penalty=0.4, temperature=0.8, seed=3),
         dict(min_p=0.2, temperature=1.0, seed=4),
         dict(logit_bias={28: 4.0, 30: -100, 1000: 2.5}, temperature=0),
         dict(logit_bias={28: 1.5, 44: 3.0}, presence_penalty=0.7, temperature=0.9, seed=5)]


def test_each_option_equals_the_reference(engine, chat_prompts):
    free = engine.generate([chat_prompts[4]], SamplingParams(max_tokens=40, temperature=0))[0]
    assert free.finish_reason == "stop"
    n = len(free.output_token_ids)                      # "hi": EOS comes early without min_tokens
    prompts = [chat_prompts[i % len(chat_prompts)] for i in range(len(CASES))] + [chat_prompts[4]]
    params = [SamplingParams(max_tokens=12, logprobs=0, **c) for c in CASES] + [SamplingParams(
        max_tokens=n + 6, min_tokens=n + 2, temperature=0, stop_token_ids=[28], logprobs=0)]
    seqs = engine.generate(prompts, params)
    for prompt, p, seq in zip(prompts, params, seqs):
        want = list(reference_tokens(engine, prompt, p, seq.output_token_ids))
        assert seq.output_token_ids == [t for t, _ in want], p
        assert [lp for lp, _ in seq.logprobs] == pytest.approx([lp for _, lp in want], abs=2e-3)
    assert len(seqs[-1].output_token_ids) >= n + 2, "min_tokens held EOS back"
    assert_no_leak(engine)


@pytest.mark.parametrize("fields,match", [(dict(presence_penalty=3), "presence_penalty"),
                                          (dict(frequency_penalty=float("nan")), "frequency_penalty"),
                                          (dict(repetition_penalty=0), "repetition_penalty"),
                                          (dict(min_p=1.5), "min_p"),
                                          (dict(min_tokens=200, max_tokens=10), "min_tokens"),
                                          (dict(min_tokens=2, json_object=True), "min_tokens"),
                                          (dict(logit_bias={5: 101}), r"logit_bias\[5\]"),
                                          (dict(logit_bias={"5": 1.0}), "logit_bias token id"),
                                          (dict(logit_bias={-1: 1.0}), "logit_bias token id"),
                                          (dict(logit_bias=[(1, 2, 3)]), "logit_bias"),
                                          (dict(logit_bias={i: 1.0 for i in range(1025)}), "logit_bias: at most")])
def test_bad_values_raise_naming_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**fields)


def test_too_many_min_tokens_stops_are_refused(engine, chat_prompts):
    with pytest.raises(ValueError, match="min_tokens"):
        engine.add_request(chat_prompts[0], SamplingParams(min_tokens=2, stop_token_ids=list(range(1, 12))))


def test_logit_bias_ids_past_the_vocabulary_are_refused(engine, chat_prompts):
    with pytest.raises(ValueError, match="logit_bias token ids out of range"):
        engine.add_request(chat_prompts[0], SamplingParams(logit_bias={engine.runner.vocab: 1.0}))


def test_a_row_of_a_biased_request_is_clean_for_its_next_owner(chat_prompts):
    """One penalty row, taken in turn by a request forced onto token 28 and by unbiased penalized ones: the
    later ones get what a fresh engine gives them."""
    later = [SamplingParams(max_tokens=8, temperature=0, presence_penalty=0.5),
             SamplingParams(max_tokens=8, temperature=0, logit_bias={30: 5.0})]
    fresh = [LLMEngine(**CPU, max_num_seqs=2).generate([chat_prompts[1]], [p])[0].output_token_ids for p in later]
    eng = LLMEngine(**CPU, max_num_seqs=2, penalty_rows=1)
    forced = eng.generate([chat_prompts[0]], SamplingParams(max_tokens=4, temperature=0, logit_bias={28: 100}))[0]
    assert forced.output_token_ids == [28] * 4
    assert [eng.generate([chat_prompts[1]], [p])[0].output_token_ids for p in later] == fresh
    assert_no_leak(eng)


def _workload(engine, chat_prompts):
    rep = ask(engine, REPEATING[0])
    return [(0, chat_prompts[0], SamplingParams(max_tokens=12, temperature=0, presence_penalty=1.0, logprobs=1)),
            (0, rep, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)),
            (1, chat_prompts[2], SamplingParams(max_tokens=12, temperature=0.8, seed=2, repetition_penalty=1.3)),
            (2, rep, SamplingParams(max_tokens=16, temperature=0, frequency_penalty=1.5, ignore_eos=True)),
            (3, chat_prompts[4], SamplingParams(max_tokens=12, temperature=0, min_tokens=8)),
            (4, chat_prompts[1], SamplingParams(max_tokens=10, temperature=0.7, seed=1, min_p=0.1)),
            (5, chat_prompts[3], SamplingParams(max_tokens=10, temperature=0, logit_bias={28: 3.0, 355: -5.0})),
            (6, rep, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))]   # speculates once alone


def ask(engine, text):
    return engine.apply_chat_template([{"role": "user", "content": text}])


def test_pipelined_graph_layout_preemption_and_speculation_equal_blocking(engine, chat_prompts):
    workload = _workload(engine, chat_prompts)
    ref = drive(LLMEngine(**CPU, depth=1), workload)
    # preempting: without the prefix cache (requests sharing cached pages would leave the small pool enough room),
    # there in the graphs' padded layouts, and with it (tests/memory/test_prefix_cache.py covers a penalized recompute
    # that maps its own outputs)
    spec = dict(speculative="ngram", num_speculative_tokens=2, penalty_rows=2, spec_min_acceptance=0.0)
    for cfg, graphs in ((dict(PREEMPTING, prefix_caching=False), True), (PREEMPTING, False), (spec, False)):
        eng = LLMEngine(**CPU, depth=2, **cfg)
        if graphs:
            eng.runner.graphs = EagerGraphs(eng.runner, guided=True)
        got = drive(eng, workload)
        assert [s.output_token_ids for s in got] == [s.output_token_ids for s in ref], cfg
        assert_no_leak(eng)
        if cfg.get("prefix_caching") is False:
            assert eng.scheduler.num_preemptions > 0
        if "speculative" in cfg:
            assert eng.timings.spec_rows > 0 and len(eng.scheduler.row_pools[1]) == 2


def test_an_engine_without_penalty_rows_refuses_them(chat_prompts):
    eng = LLMEngine(**CPU, penalty_rows=0, max_num_seqs=2)
    with pytest.raises(ValueError, match="penalt"):
        eng.add_request(chat_prompts[0], SamplingParams(presence_penalty=0.5))


@pytest.mark.gpu
def test_gpu_graphs_equal_eager(engine, chat_prompts):
    gpu = dict(device="cuda", dtype="float32", attention_backend="triton", max_model_len=1024)
    workload = _workload(engine, chat_prompts)
    ref = drive(LLMEngine(**gpu, enforce_eager=True), workload)
    eng = LLMEngine(**gpu, debug_sync=True)
    assert [s.output_token_ids for s in drive(eng, workload)] == [s.output_token_ids for s in ref]
    assert eng.runner.graphs.replays["decode"] > 0
    assert_no_leak(eng)
