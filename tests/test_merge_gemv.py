"""engine.kernels.matmul.merge_gemv (o_proj's decode GEMV merging the attention's KV splits in its prologue)
against the combine kernel then decode_linear, and an engine with it on against off. Without CUDA the kernels run
in the Triton CPU interpreter (tests/conftest.py: triton_module)."""
import pytest
import torch

from conftest import triton_module
from engine.kernels.attention import split_merge as sm

mg = triton_module("matmul.merge_gemv")
dg = triton_module("matmul.decode_gemv")
DEV = "cpu" if mg.interpreted() else "cuda"


def partials(rows, heads, splits, head_dim, seed, empty=()):
    """Random split partials as decode_attention leaves them; (token, head, split) in `empty` saw no key."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    pad = max(16, 1 << (head_dim - 1).bit_length())
    acc = torch.randn(rows, heads, splits, pad, generator=g, device=DEV)
    m = torch.randn(rows, heads, splits, generator=g, device=DEV) * 4
    l = torch.rand(rows, heads, splits, generator=g, device=DEV) + 0.5
    for t, h, s in empty:
        acc[t, h, s], m[t, h, s], l[t, h, s] = 0.0, float("-inf"), 0.0
    return mg.SplitPartials(acc, m, l)


def combined(p, head_dim, dtype):
    """The combine kernel's output [rows, heads, head_dim]."""
    rows, heads = p.m.shape[:2]
    out = torch.empty(rows, heads, head_dim, dtype=dtype, device=DEV)
    cu = torch.arange(rows + 1, dtype=torch.int32, device=DEV)
    sm.combine_splits(*p, out, cu, rows, p.acc.shape[-1])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows,heads,splits,head_dim", [(1, 9, 4, 64), (3, 4, 2, 24), (4, 2, 8, 64)])
def test_matches_the_combine_then_linear(rows, heads, splits, head_dim, dtype):
    p = partials(rows, heads, splits, head_dim, seed=rows + splits, empty=[(0, 1, 0)])
    g = torch.Generator(device=DEV).manual_seed(7)
    w = (torch.randn(40, heads * head_dim, generator=g, device=DEV) / (heads * head_dim) ** 0.5).to(dtype)
    got = mg.merge_linear(p, w, head_dim)
    want = dg.decode_linear(combined(p, head_dim, dtype).view(rows, -1), w)
    assert got.shape == (rows, 40) and got.dtype == dtype
    # fp32: the merge's sum over splits in another order; bf16: an activation may round to the next value
    atol = 1e-5 if dtype == torch.float32 else 2 ** -6 * want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-5 if dtype == torch.float32 else 2 ** -7, atol=atol)


def test_refusals_name_the_problem():
    p = partials(2, 4, 2, 16, seed=1)
    w = torch.randn(8, 64, device=DEV)
    with pytest.raises(ValueError, match="heads"):
        mg.merge_linear(p, torch.randn(8, 60, device=DEV), 16)
    with pytest.raises(ValueError, match="float32"):
        mg.merge_linear(mg.SplitPartials(p.acc.half(), p.m, p.l), w, 16)
    with pytest.raises(ValueError, match="rows"):
        mg.merge_linear(partials(dg.MAX_ROWS + 1, 4, 2, 16, seed=2), w, 16)


def test_engine_with_the_merge_in_o_proj_keeps_the_tokens(monkeypatch):
    """merge_in_o with 4 forced splits (the rule picks 1 on the CPU): every decode step's o_proj takes the merge and
    the greedy outputs are those of the combine kernel."""
    from engine.llm_engine import LLMEngine
    from engine.requests.sequence import SamplingParams
    from helpers import INTERPRETER_SETTINGS
    da = triton_module("attention.decode_attention")
    prompts = [[5, 17, 99, 3, 250, 42, 7], [300, 1, 2], list(range(40, 140))]
    results = []
    for on in (False, True):
        eng = LLMEngine(model="dummy:tiny", device=DEV, dtype="float32", attention_backend="triton",
                        **INTERPRETER_SETTINGS, depth=2, max_num_seqs=4, max_model_len=128, enforce_eager=True,
                        decode_attention_splits=4, merge_in_o=on)
        backend = eng.runner.backend
        backend._decode_attn, backend._gemv = da, dg            # this file's (interpreter-built) modules
        calls, real = [], mg.merge_linear
        if on:
            backend._merge_gemv = mg
            monkeypatch.setattr(mg, "merge_linear", lambda *a: calls.append(a[1].shape) or real(*a))
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (9, 4, 6)]
        results.append([s.output_token_ids for s in eng.generate(prompts, params)])
        assert bool(calls) == on
    assert results[1] == results[0]
