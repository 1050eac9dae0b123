"""GPU: the architecture families and the dummy shapes of the published models on the fast paths.

The tiny random checkpoints of test_model_families (Llama 3.2, Qwen2 with QKV bias, Qwen3 with QK norm, Mistral) in
float32 through the Triton backend, eager and with CUDA graphs, give the torch reference path's greedy tokens. Each
published model's dummy shape builds in bf16 and decodes a few steps to finite logits."""
import gc

import pytest
import torch

from conftest import assert_no_leak, prefill_logits
from engine.requests.sequence import SamplingParams
from test_model_families import FAMILIES, PROMPTS, tiny_checkpoint, tiny_engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SHAPES = ("llama-3b", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "qwen3-1.7b", "qwen3-8b", "mistral-7b")
WEIGHT_BUDGET = 30 << 30            # shapes whose bf16 weights pass this are skipped


def _tokens(directory, **cfg):
    engine = tiny_engine(directory, device="cuda", num_kv_blocks=64, **cfg)
    seqs = engine.generate(PROMPTS, GREEDY)
    assert_no_leak(engine)
    return [s.output_token_ids for s in seqs], engine


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    """A family's checkpoint directory and the torch reference path's greedy tokens on it (CUDA, float32)."""
    directory = tmp_path_factory.mktemp(request.param)
    tiny_checkpoint(request.param, directory)
    return directory, _tokens(directory, attention_backend="torch", enforce_eager=True)[0]


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_fp32_triton_equals_torch_reference(checkpoint, eager):
    directory, expected = checkpoint
    got, engine = _tokens(directory, attention_backend="triton", enforce_eager=eager)
    assert got == expected
    assert (engine.runner.graphs is None) == eager


def _weight_bytes(shape: str) -> int:
    from engine.models.llama import LlamaForCausalLM
    from engine.models.loader import resolve_model
    with torch.device("meta"):
        model = LlamaForCausalLM(resolve_model(f"dummy:{shape}").config)
    return 2 * sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("shape", SHAPES)
def test_dummy_shape_decodes_to_finite_logits_in_bf16(shape):
    """Random weights at the published dimensions (QKV bias, QK norm, tied heads, llama3 RoPE as each family has
    them) through the default fast path: the kernels take each shape, and the dummy weights' scale keeps bf16
    finite over the full depth."""
    from engine.llm_engine import LLMEngine
    need = _weight_bytes(shape)
    if need > min(WEIGHT_BUDGET, torch.cuda.mem_get_info()[0] - (2 << 30)):
        pytest.skip(f"dummy:{shape}'s bf16 weights take {need / 2**30:.1f} GiB")
    engine = LLMEngine(model=f"dummy:{shape}", device="cuda", dtype="bfloat16", max_num_seqs=4, max_model_len=256,
                       num_kv_blocks=64)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, engine.runner.vocab, (n,), generator=g).tolist() for n in (11, 30, 5)]
    seqs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert all(len(s.output_token_ids) == 8 for s in seqs)
    assert_no_leak(engine)
    ids = prompts[0] + seqs[0].output_token_ids
    logits = prefill_logits(engine, ids, last=len(ids))
    assert logits.shape == (len(ids), engine.runner.vocab)
    assert torch.isfinite(logits).all()
    assert logits.std() > 0
    del engine, seqs
    gc.collect()
