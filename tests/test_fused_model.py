"""The fused path (Triton kernels; the CPU interpreter here) gives the reference path's greedy tokens.

A tiny dummy Llama keeps the interpreter fast. Both loops (blocking and pipelined) and chunked prefill
run through the fused path; on CUDA the same test compiles the kernels and adds decode CUDA graphs.
"""
import pytest
import torch

from conftest import assert_no_leak, prefill_logits
from engine.llm_engine import LLMEngine
from engine.sequence import SamplingParams

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[5, 17, 99, 3, 250, 42, 7], [300, 1, 2], list(range(40, 71)), [11] * 5]


def _tokens(backend, depth, **cfg):
    eng = LLMEngine(model="dummy:tiny", device=DEVICE, dtype="float32", attention_backend=backend, depth=depth,
                    max_num_seqs=4, max_model_len=256, **cfg)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (9, 4, 12, 6)]
    seqs = eng.generate(PROMPTS, params)
    assert_no_leak(eng)
    return [s.output_token_ids for s in seqs]


@pytest.fixture(scope="module")
def reference():
    return _tokens("torch", 1)


@pytest.mark.parametrize("decode_gemv", [False, True], ids=["cublas", "decode_gemv"])
@pytest.mark.parametrize("depth", [1, 2], ids=["depth1", "depth2"])
def test_fused_path_matches_reference(reference, depth, decode_gemv):
    # 16 tokens a step: prompts go in chunks; steps of <= 4 rows take the decode GEMV when it is on
    assert _tokens("triton", depth, max_num_batched_tokens=16, decode_gemv=decode_gemv) == reference


def test_fused_logits_close_to_reference():
    """Beyond argmax: the prefill logits of both paths agree to float32 rounding."""
    logits = {backend: prefill_logits(LLMEngine(model="dummy:tiny", device=DEVICE, dtype="float32",
                                                attention_backend=backend, max_model_len=256), PROMPTS[2])
              for backend in ("torch", "triton")}
    ref, got = logits["torch"], logits["triton"]
    assert ((got - ref).norm() / ref.norm()).item() < 1e-5


def test_fused_path_with_rope_as_its_own_kernel(reference):
    """rope_attention off: RoPE + KV store run as their own kernel before attention, with the same tokens."""
    assert _tokens("triton", 2, max_num_batched_tokens=16, rope_attention=False) == reference


@pytest.mark.gpu
def test_fused_path_with_splits_merged_in_the_attention_kernel(reference):
    """split_merge: split attention (small batches on a GPU; the CPU never splits) merges in its own kernel."""
    assert _tokens("triton", 2, max_num_batched_tokens=16, split_merge=True) == reference
