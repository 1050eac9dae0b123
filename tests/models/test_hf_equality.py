"""The engine's greedy tokens equal Hugging Face transformers' greedy generate on the same weights."""
import pytest
import torch

from conftest import assert_no_leak, hf_greedy, prefill_logits
from engine.requests.sequence import SamplingParams

NEW = 48
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_tokens(hf_model, chat_prompts):
    return [hf_greedy(hf_model, p, NEW) for p in chat_prompts]


def test_single_requests_match_hf(engine, chat_prompts, hf_tokens):
    for prompt, expected in zip(chat_prompts, hf_tokens):
        [seq] = engine.generate([prompt], GREEDY)
        assert seq.output_token_ids == expected
    assert_no_leak(engine)


def test_batched_requests_match_hf(engine, chat_prompts, hf_tokens):
    assert len({len(p) for p in chat_prompts}) > 1, "prompts should differ in length"
    seqs = engine.generate(chat_prompts, GREEDY)
    assert [s.output_token_ids for s in seqs] == hf_tokens
    assert_no_leak(engine)


def test_chunked_prefill_matches_hf(engine, chat_prompts, hf_tokens):
    """A tiny token budget splits every prompt into chunks that attend to earlier cached pages."""
    from engine.llm_engine import LLMEngine
    small = LLMEngine(device="cpu", dtype="float32", attention_backend="torch", max_num_seqs=4,
                      max_num_batched_tokens=7)
    seqs = small.generate(chat_prompts[:3], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert [s.output_token_ids for s in seqs] == [t[:16] for t in hf_tokens[:3]]
    assert_no_leak(small)


def test_prefill_logits_match_hf(engine, hf_model, chat_prompts):
    """Beyond argmax: the last-position logits agree closely in float32."""
    prompt = chat_prompts[2]
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0, -1]
    logits = prefill_logits(engine, prompt)
    rel = (logits - ref).norm() / ref.norm()
    assert rel < 1e-4, rel


@pytest.mark.slow
def test_converted_weights_equal_transformers_gguf_loader(engine):
    """Our GGUF conversion (dequantize + q/k un-permute) equals transformers' own GGUF loader."""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM
    from engine.models.loader import DEFAULT_GGUF, _fetch_default_gguf
    if engine.source.name != "SmolLM2-135M-Instruct":
        pytest.skip("only for the default model")
    gguf = _fetch_default_gguf()
    ref = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=DEFAULT_GGUF, dtype=torch.float32)
    ours = AutoModelForCausalLM.from_pretrained(str(engine.source.path), dtype=torch.float32)
    ref_sd, our_sd = ref.state_dict(), ours.state_dict()
    assert ref_sd.keys() == our_sd.keys()
    for name in ref_sd:
        assert torch.equal(ref_sd[name], our_sd[name]), name
