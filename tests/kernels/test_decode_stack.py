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


def _step(model, contexts, dtype, seed=1, q_lens=None):
    """(x, positions, meta, kv caches) of a step whose sequences have `contexts` cached keys and q_lens new tokens
    each (default one: a decode step), with random cache contents and each sequence's pages scattered through the
    pool."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.cfg
    q_lens = q_lens or [1] * len(contexts)
    pages_per_row = max((c + q) // BLOCK + 1 for c, q in zip(contexts, q_lens))
    num_blocks = len(contexts) * pages_per_row + 3
    caches = kv_pages(cfg["num_hidden_layers"], (num_blocks, BLOCK, cfg["num_key_value_heads"], cfg["head_dim"]),
                      dtype, DEV)
    for k, v in caches:
        k.copy_(torch.randn(k.shape, generator=g).to(dtype))
        v.copy_(torch.randn(v.shape, generator=g).to(dtype))
    order = torch.randperm(num_blocks, generator=g)
    tables = order[:len(contexts) * pages_per_row].view(len(contexts), pages_per_row).to(torch.int32)
    positions = torch.tensor([c + j for c, q in zip(contexts, q_lens) for j in range(q)])
    seq_of = [i for i, q in enumerate(q_lens) for _ in range(q)]
    slots = torch.tensor([tables[i, p // BLOCK].item() * BLOCK + p % BLOCK for i, p in zip(seq_of, positions.tolist())])
    cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([c + q for c, q in zip(contexts, q_lens)], dtype=torch.int32)
    meta = AttentionMetadata(slot_mapping=slots.to(DEV), cu_seqlens_q=cu.to(DEV), seq_lens=seq_lens.to(DEV),
                             block_tables=tables.to(DEV), max_query_len=max(q_lens), max_seq_len=int(seq_lens.max()))
    x = (torch.randn(len(positions), cfg["hidden_size"], generator=g) * 0.5).to(dtype).to(DEV)
    return x, positions.to(DEV), meta, caches


def _both(shape, contexts, dtype=torch.float32, num_splits=None, programs=None, q_lens=None, aux_layers=()):
    model = _model(SHAPES[shape], dtype)
    x, positions, meta, caches = _step(model, contexts, dtype, q_lens=q_lens)
    ref_caches = [(k.clone(), v.clone()) for k, v in caches]
    with torch.no_grad():
        ref = model.forward(None, positions, meta, ref_caches, TorchBackend(), aux_layers=aux_layers, embeds=x.clone())
    stack = stack_mod.DecodeStack(model, caches, programs=programs, aux_layers=aux_layers)
    got = stack(x.clone(), positions, meta, aux=bool(aux_layers), num_splits=num_splits)
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


@pytest.mark.parametrize("contexts,q_lens", [([9], [4]), ([0, 33], [2, 2]), ([70, 5, 16], [1, 2, 1])])
def test_verification_steps_see_their_sequences_earlier_new_tokens(contexts, q_lens):
    """Several new tokens a sequence (a verification step): each attends to the cache and to its sequence's new
    tokens up to itself, and stores its own key and value."""
    got, ref, caches, ref_caches, _ = _both("gqa3", contexts, q_lens=q_lens, num_splits=2)
    torch.testing.assert_close(got, ref, **TOL[torch.float32])
    for (k, v), (rk, rv) in zip(caches, ref_caches):
        torch.testing.assert_close(k, rk, **TOL[torch.float32])
        torch.testing.assert_close(v, rv, **TOL[torch.float32])


def test_aux_layers_outputs_as_the_model_returns_them():
    """A draft head's inputs: the outputs of the layers asked, in the order asked (one asked twice, the last)."""
    (got, got_aux), (ref, ref_aux), *_ = _both("qwen2-bias", [12], q_lens=[4], aux_layers=(2, 0, 2))
    torch.testing.assert_close(got, ref, **TOL[torch.float32])
    torch.testing.assert_close(got_aux, ref_aux, **TOL[torch.float32])


def test_every_layer_output_within_fp32_rounding_of_the_reference():
    """Each layer's output (the residual stream after it), not only the last: a relative error of at most 2e-5 of
    the largest value (fp32: the two paths sum in different orders)."""
    layers = tuple(range(SHAPES["qwen2-bias"]["num_hidden_layers"]))
    (_, got), (_, ref), *_ = _both("qwen2-bias", [30, 2], aux_layers=layers)
    h = SHAPES["qwen2-bias"]["hidden_size"]
    for i in layers:
        g, r = got[:, i * h:(i + 1) * h], ref[:, i * h:(i + 1) * h]
        assert (g - r).abs().max() <= 2e-5 * r.abs().max(), f"layer {i}"


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
    with pytest.raises(ValueError, match="as many positions"):
        stack(x.clone(), positions[:0], meta)
    with pytest.raises(ValueError, match="without aux_layers"):
        stack(x.clone(), positions, meta, aux=True)
    x, positions, meta, _ = _step(_model(TINY, torch.float32), [3, 5], torch.float32)
    with pytest.raises(ValueError, match="positions must have unit stride"):     # entry i is read at offset i
        stack(x.clone(), torch.stack([positions, positions], 1)[:, 0], meta)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_gpu_one_program_an_sm(dtype, rows):
    """Launches in a row on one stack: each leaves its counters at zero for the next, and each gives the reference's
    hidden states (its KV store writes the same values each time)."""
    contexts = [7, 300, 64, 500][:rows]        # within the tiny model's RoPE table (512 positions)
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


@pytest.mark.gpu
def test_gpu_a_step_is_one_launch():
    """The whole stack of a decode step is one kernel (its buffers are allocations, not kernels)."""
    from torch.profiler import ProfilerActivity, profile
    model = _model(SHAPES["llama"], torch.bfloat16)
    x, positions, meta, caches = _step(model, [40, 3], torch.bfloat16)
    stack = stack_mod.DecodeStack(model, caches)
    stack(x.clone(), positions, meta)           # compiled first
    work = x.clone()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        stack(work, positions, meta)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    assert kernels == ["decode_stack_kernel"], kernels
