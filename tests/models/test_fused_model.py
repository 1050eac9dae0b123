"""The fused path (Triton kernels; the CPU interpreter here) gives the reference path's greedy tokens.

A tiny dummy Llama keeps the interpreter fast. Both loops (blocking and pipelined) and chunked prefill
run through the fused path; on CUDA the same test compiles the kernels and adds decode CUDA graphs.
"""
import pytest
import torch

from conftest import assert_no_leak, prefill_logits
from engine.kernels.routes import pins
from engine.llm_engine import LLMEngine
from engine.requests.sequence import SamplingParams

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


GEMV = pins(dict(kernel="gemv", rows=[1, 8]))                                    # every matmul and head it takes
GEMM = pins(dict(kernel="gemv", rows=1), *[dict(kernel="gemm", op=op, rows=[2, 32])   # decode_gemm from 2 rows
                                            for op in ("linear", "norm_linear", "norm_linear_silu")])


# in the interpreter each loop with one matmul path (each path and each loop still run); every pair on a GPU
@pytest.mark.parametrize("depth,routes", [(1, "reference"), (2, GEMV)] + (
    [(1, GEMV), (2, "reference"), (2, "")] if DEVICE == "cuda" else []))
def test_fused_path_matches_reference(reference, depth, routes):
    """16 tokens a step: prompts go in chunks; steps of <= 8 rows take the decode GEMV where it is pinned, every
    matmul cuBLAS under kernels="reference", the measured routes on a GPU ("")."""
    kw = dict(kernels="reference") if routes == "reference" else dict(kernel_routes=routes)
    assert _tokens("triton", depth, max_num_batched_tokens=16, **kw) == reference


def test_fused_logits_close_to_reference():
    """Beyond argmax: the prefill logits of both paths agree to float32 rounding."""
    logits = {backend: prefill_logits(LLMEngine(model="dummy:tiny", device=DEVICE, dtype="float32",
                                                attention_backend=backend, max_model_len=256), PROMPTS[2])
              for backend in ("torch", "triton")}
    ref, got = logits["torch"], logits["triton"]
    assert ((got - ref).norm() / ref.norm()).item() < 1e-5


def test_fused_path_through_the_persistent_decode_stack(reference, monkeypatch):
    """Decode steps of 1-4 rows pinned to the persistent stack (the whole layer stack in one launch; its kernel
    runs one program in the interpreter) give the same tokens, steps of one and of several rows among them."""
    from engine.kernels.persistent import stack
    calls = []
    real = stack.DecodeStack.__call__
    monkeypatch.setattr(stack.DecodeStack, "__call__", lambda self, x, *a, **kw: calls.append(x.shape[0]) or
                        real(self, x, *a, **kw))
    routes = pins(dict(op="stack", kernel="persistent", rows=[1, 4]))
    assert _tokens("triton", 2, max_num_batched_tokens=16, kernel_routes=routes) == reference
    assert 1 in calls and max(calls) > 1        # (on a GPU: at graph capture; replays run the captured launch)


def test_fused_path_on_decode_gemm(reference):
    """Steps of 2-4 rows on decode_gemm (its SiLU * up epilogue in gate_up), with the same tokens."""
    assert _tokens("triton", 2, max_num_batched_tokens=16, kernel_routes=GEMM) == reference


def test_fused_path_without_decode_attention(reference):
    """decode_attention off: decode steps' attention in paged_attention (rope=), with the same tokens."""
    assert _tokens("triton", 2, max_num_batched_tokens=16, decode_attention=False) == reference


def test_fused_path_with_rope_as_its_own_kernel(reference):
    """rope_attention off: RoPE + KV store run as their own kernel before attention, with the same tokens."""
    assert _tokens("triton", 2, max_num_batched_tokens=16, rope_attention=False) == reference


@pytest.mark.gpu
def test_fused_path_with_splits_merged_by_a_combine_kernel(reference):
    """split_merge off: split attention (small batches on a GPU; the CPU never splits) merges its splits in a
    kernel of its own, not in the attention kernel, with the same tokens."""
    assert _tokens("triton", 2, max_num_batched_tokens=16, split_merge=False) == reference


def _prefill_features(engine, ids, aux_layers):
    """(final hidden states, the aux layers' outputs) of a one-shot prefill of `ids`, as an EAGLE step reads them."""
    from engine.scheduler import ScheduledRow
    from engine.requests.sequence import SamplingParams, Sequence
    seq = Sequence(10**6, list(ids), SamplingParams(max_tokens=1), seed=0,
                   block_table=engine.blocks.allocate(engine.blocks.blocks_needed(len(ids), 0)))
    runner, slot, n = engine.runner, engine.runner.slots[0], len(ids)
    try:
        runner.prepare(slot, [ScheduledRow(seq, 0, n, True)])
        slot.upload()
        with torch.inference_mode():
            meta = runner.program.meta(slot, n, 1, n, n)
            return runner.model(slot.dev["input_ids"][:n], slot.dev["positions"][:n], meta, runner.kv_caches,
                                runner.backend, aux_layers)
    finally:
        engine.blocks.free(seq.block_table)


def test_fused_path_gives_the_reference_aux_layers():
    """The layers' outputs an EAGLE head reads (the fused path takes them from the next layer's norm and the
    final norm, which add them anyway): the reference path's, in the order asked, a layer asked twice."""
    aux = (1, 0, 1)
    out = {backend: _prefill_features(LLMEngine(model="dummy:tiny", device=DEVICE, dtype="float32",
                                                attention_backend=backend, max_model_len=256), PROMPTS[2], aux)
           for backend in ("torch", "triton")}
    (ref_h, ref_aux), (h, got) = out["torch"], out["triton"]
    assert got.shape == ref_aux.shape == (len(PROMPTS[2]), 3 * ref_h.shape[1])
    for a, b in ((h, ref_h), (got, ref_aux)):
        assert ((a - b).norm() / b.norm()).item() < 1e-5
