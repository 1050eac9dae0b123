"""engine.kernels.sampling.argmax (a step's logits to greedy tokens, two kernels) against torch.argmax, index for index.
Without CUDA the kernels run in the Triton CPU interpreter (tests/conftest.py)."""
import pytest
import torch

from conftest import triton_module

am = triton_module("sampling.argmax")
DEV = "cpu" if am.interpreted() else "cuda"
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])


@pytest.fixture(params=["wide", "narrow"])
def blocks(request, monkeypatch):
    """"narrow": 16 logits a kernel-1 program and 2 partials a kernel-2 pass, so both loops see ragged tails."""
    if request.param == "narrow":
        monkeypatch.setattr(am, "BLOCK_V", 16)
        monkeypatch.setattr(am, "BLOCK_P", 2)


def randn(*shape, seed, dtype=torch.float32):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEV).to(dtype)


@DTYPES
@pytest.mark.parametrize("m,v", [(1, 7), (4, 300), (5, 1031), (32, 257)])
def test_equals_torch(dtype, m, v, blocks):
    x = randn(m, v + 3, seed=m + v, dtype=dtype)[:, 1:1 + v]        # rows strided past V, unit stride in V
    got = am.argmax_rows(x)
    assert got.dtype == torch.int64 and got.shape == (m,)
    assert torch.equal(got, x.argmax(-1))


@DTYPES
def test_ties_give_the_first_column(dtype, blocks):
    """A row's largest value repeated in one program, in a later one and in the last column (and bf16 rounds
    neighbours together): the first wins, as in torch.argmax."""
    v = 100
    x = randn(4, v, seed=1, dtype=dtype)
    for r, cols in enumerate([[3, 4, 50, v - 1], [40, 90], [v - 1, 0], [17, 18]]):
        x[r, cols] = 9.0
    got = am.argmax_rows(x)
    assert got.tolist() == [3, 40, 0, 17] and torch.equal(got, x.argmax(-1))


def test_rows_of_minus_infinity_and_nan(blocks):
    """All -inf: column 0 (the lanes past V hold -inf too and must not win); a NaN beats every number, the first
    NaN every later one, +inf included."""
    v = 70
    x = torch.full((4, v), float("-inf"), device=DEV)
    x[1] = randn(v, seed=2)
    x[1, [33, 60]] = float("nan")
    x[2, [5, 65]] = float("inf")
    x[2, 66] = float("nan")
    x[3] = -1e30
    got = am.argmax_rows(x)
    assert got.tolist() == [0, 33, 66, 0] and torch.equal(got, x.argmax(-1))


@pytest.mark.parametrize("m,v", [(1, 7), (5, 1031)])
def test_ids_map_the_columns(m, v, blocks):
    """With a draft vocabulary's ids (column -> token id), kernel 2 writes the token id of the argmax column."""
    x = randn(m, v, seed=v)
    ids = torch.randperm(10 * v, generator=torch.Generator().manual_seed(v))[:v].to(DEV)
    assert torch.equal(am.argmax_rows(x, ids), ids[x.argmax(-1)])


def test_bad_ids():
    x = torch.zeros(2, 5, device=DEV)
    with pytest.raises(ValueError, match="all 5 columns"):
        am.argmax_rows(x, torch.arange(4, device=DEV))
    with pytest.raises(ValueError, match="ids must have unit stride"):
        am.argmax_rows(x, torch.arange(10, device=DEV)[::2])
    with pytest.raises(TypeError, match="ids dtype"):
        am.argmax_rows(x, torch.arange(5, dtype=torch.int32, device=DEV))


def test_empty_and_bad_inputs():
    assert am.argmax_rows(torch.zeros(0, 5, device=DEV)).shape == (0,)
    with pytest.raises(ValueError, match="no columns"):
        am.argmax_rows(torch.zeros(3, 0, device=DEV))
    with pytest.raises(TypeError, match="dtype"):
        am.argmax_rows(torch.zeros(3, 5, dtype=torch.int64, device=DEV))
    with pytest.raises(ValueError, match="unit stride"):
        am.argmax_rows(torch.zeros(5, 3, device=DEV).t())
    with pytest.raises(ValueError, match="2-D"):
        am.argmax_rows(torch.zeros(5, device=DEV))
