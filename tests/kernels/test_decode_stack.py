"""The persistent decode stack (engine/kernels/persistent/) against the model's reference path: a decode step of
1-4 rows over a paged cache gives the reference's final hidden states (fp32 rounding) and stores the same new
keys and values, for Llama's shape, grouped heads of 3, a QKV bias (Qwen2) and KV splits merged in the kernel.

Without CUDA the kernel runs in the Triton CPU interpreter, one program, float32 only (the interpreter's bf16
products are not the GPU's; tests/conftest.py: triton_module); on a GPU, one program an SM, in float32 and bf16.
"""
import importlib

import pytest
import torch

from conftest import triton_module
from engine.attention import AttentionMetadata
from engine.backend import TorchBackend
from engine.memory.kv_cache import kv_pages
from engine.models.llama import LlamaForCausalLM

triton_module("persistent.decode_stack")
stack_mod = importlib.import_module("engine.kernels.persistent.stack")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 16
TINY = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=64, rope_theta=10000.0, rms_norm_eps=1e-5,
            max_position_embeddings=512)
SHAPES = {"llama": TINY, "gqa3": dict(TINY, num_attention_heads=6, num_key_value_heads=2, intermediate_size=80),
          "qwen2-bias": dict(TINY, model_type="qwen2", num_hidden_layers=3)}


def _model(cfg, dtype, seed=0):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(DEV)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    model = model.to(dtype)
    model.init_rope(cfg["max_position_embeddings"], DEV)
    return model


def _step(model, contexts, dtype, seed=1):
    """(x, positions, meta, kv caches) of a decode step whose rows have `contexts` cached keys each (random cache
    contents; each row's pages are scattered through the pool)."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.cfg
    pages_per_row = max(c // BLOCK + 1 for c in contexts)
    num_blocks = len(contexts) * pages_per_row + 3
    caches = kv_pages(cfg["num_hidden_layers"], (num_blocks, BLOCK, cfg["num_key_value_heads"], cfg["head_dim"]),
                      dtype, DEV)
    for k, v in caches:
        k.copy_(torch.randn(k.shape, generator=g).to(dtype))
        v.copy_(torch.randn(v.shape, generator=g).to(dtype))
    order = torch.randperm(num_blocks, generator=g)
    tables = order[:len(contexts) * pages_per_row].view(len(contexts), pages_per_row).to(torch.int32)
    positions = torch.tensor(contexts, dtype=torch.int64)
    slots = torch.tensor([tables[i, c // BLOCK].item() * BLOCK + c % BLOCK for i, c in enumerate(contexts)])
    meta = AttentionMetadata(slot_mapping=slots.to(DEV), cu_seqlens_q=torch.arange(len(contexts) + 1,
                                                                                    dtype=torch.int32).to(DEV),
                             seq_lens=(positions + 1).to(torch.int32).to(DEV), block_tables=tables.to(DEV),
                             max_query_len=1, max_seq_len=max(contexts) + 1)
    x = (torch.randn(len(contexts), cfg["hidden_size"], generator=g) * 0.5).to(dtype).to(DEV)
    return x, positions.to(DEV), meta, caches


def _both(shape, contexts, dtype=torch.float32, num_splits=None, programs=None):
    model = _model(SHAPES[shape], dtype)
    x, positions, meta, caches = _step(model, contexts, dtype)
    ref_caches = [(k.clone(), v.clone()) for k, v in caches]
    with torch.no_grad():
        ref = model.forward(None, positions, meta, ref_caches, TorchBackend(), embeds=x.clone())
    stack = stack_mod.DecodeStack(model, caches, programs=programs)
    got = stack(x.clone(), positions, meta, num_splits=num_splits)
    return got, ref, caches, ref_caches, stack


TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


@pytest.mark.parametrize("shape,contexts", [("llama", [0]), ("llama", [5, 16, 33, 70]), ("gqa3", [15, 64, 1]),
                                            ("qwen2-bias", [40, 3])])
def test_matches_the_reference_path(shape, contexts):
    """Contexts of no cached key, within a page, on a page's end and across several pages and KV tiles."""
    got, ref, caches, ref_caches, stack = _both(shape, contexts)
    torch.testing.assert_close(got, ref, **TOL[torch.float32])
    for (k, v), (rk, rv) in zip(caches, ref_caches):
        torch.testing.assert_close(k, rk, **TOL[torch.float32])
        torch.testing.assert_close(v, rv, **TOL[torch.float32])
    assert not stack.counters.any() and not stack.tickets.any(), "counters are zero again after the launch"


@pytest.mark.parametrize("num_splits", [2, 4])
def test_kv_splits_merge_in_the_kernel(num_splits):
    got, ref, *_ = _both("gqa3", [70, 9, 130], num_splits=num_splits)
    torch.testing.assert_close(got, ref, **TOL[torch.float32])


def test_a_second_stack_reuses_the_stacked_weights():
    """The constructor points each layer's parameters at slices of one tensor: a second one copies nothing, and
    the model's own forward reads the same values."""
    model = _model(TINY, torch.float32)
    _, _, _, caches = _step(model, [3], torch.float32)
    first = stack_mod.DecodeStack(model, caches)
    before = model.layers[1].mlp.down_proj.weight.detach().clone()
    second = stack_mod.DecodeStack(model, caches)
    assert second.w_d.data_ptr() == first.w_d.data_ptr() == model.layers[0].mlp.down_proj.weight.data_ptr()
    assert torch.equal(model.layers[1].mlp.down_proj.weight, before)


def test_refuses_what_it_cannot_run():
    model = _model(dict(TINY, model_type="qwen3"), torch.float32)
    x, positions, meta, caches = _step(_model(TINY, torch.float32), [3], torch.float32)
    with pytest.raises(ValueError, match="QK norm"):
        stack_mod.DecodeStack(model, caches)
    stack = stack_mod.DecodeStack(_model(TINY, torch.float32), caches)
    with pytest.raises(ValueError, match="1 to 4 rows"):
        stack(torch.zeros(5, 64, device=DEV), positions, meta)
    with pytest.raises(ValueError, match="one new token"):
        meta.max_query_len = 2
        stack(x.clone(), positions, meta)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_gpu_one_program_an_sm(dtype, rows):
    """Launches in a row on one stack: each leaves its counters at zero for the next, and each gives the reference's
    hidden states (its KV store writes the same values each time)."""
    contexts = [7, 300, 64, 1000][:rows]
    got, ref, caches, ref_caches, stack = _both("gqa3", contexts, dtype)
    torch.testing.assert_close(got, ref, **TOL[dtype])
    x, positions, meta, _ = _step(stack.model, contexts, dtype)
    for _ in range(3):
        torch.testing.assert_close(stack(x.clone(), positions, meta), got, rtol=0, atol=0)
    assert stack.programs > 1 and not stack.counters.any()


@pytest.mark.gpu
def test_gpu_cuda_graph_replays():
    """Captured once, replayed: the counters zero themselves inside the graph too."""
    got, ref, caches, ref_caches, stack = _both("llama", [40, 3], torch.bfloat16)
    x, positions, meta, _ = _step(stack.model, [40, 3], torch.bfloat16)
    work = x.clone()
    graph = torch.cuda.CUDAGraph()
    stack(work, positions, meta)                # compiled before the capture
    work.copy_(x)
    with torch.cuda.graph(graph):
        out = stack(work, positions, meta)
    for _ in range(3):
        work.copy_(x)
        graph.replay()
        torch.testing.assert_close(out, got, rtol=0, atol=0)
