"""engine/kernels/matmul/cpu_gemm.py: the native CPU matmul of a few rows against F.linear, its batch invariance, and
where it hands over to F.linear."""
import pytest
import torch
import torch.nn.functional as F

from engine.kernels.matmul import cpu_gemm

pytestmark = pytest.mark.skipif(not cpu_gemm.NATIVE, reason="the native CPU matmul is not built or needs AVX2+FMA")


def _ours(x, w, b=None):
    assert cpu_gemm.applies(x, w, b)
    return cpu_gemm.linear(x, w, b)


@pytest.mark.parametrize("k", [576, 1536, 13])            # 13: a tail shorter than one vector
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16])        # 9 and 16: two passes over the weights
def test_equals_f_linear(rows, k):
    g = torch.Generator().manual_seed(rows * 1000 + k)
    x, w, b = torch.randn(rows, k, generator=g), torch.randn(333, k, generator=g), torch.randn(333, generator=g)
    torch.testing.assert_close(_ours(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(_ours(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(16, 576, generator=g), torch.randn(1000, 576, generator=g)
    alone = torch.cat([_ours(x[i:i + 1], w) for i in range(16)])
    for rows in (2, 5, 8, 16):
        assert torch.equal(_ours(x[:rows], w), alone[:rows])
    assert torch.equal(_ours(x[3:11], w), alone[3:11])


def test_strided_and_batched_inputs_and_threads_give_the_same_bits():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(70_000, 64, generator=g)        # wide enough to split over threads
    x = torch.randn(2, 3, 128, generator=g)[..., ::2]          # [2, 3, 64], stride 2 in the last dim
    ref = _ours(x.reshape(6, 64).contiguous(), w)
    out = _ours(x, w)
    assert out.shape == (2, 3, 70_000) and torch.equal(out.reshape(6, -1), ref)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(_ours(x, w).reshape(6, -1), ref)
    finally:
        torch.set_num_threads(before)


def test_what_it_leaves_to_f_linear():
    x, w = torch.randn(4, 32), torch.randn(8, 32)
    assert cpu_gemm.applies(x, w)
    assert not cpu_gemm.applies(torch.randn(17, 32), w)                       # rows past MAX_ROWS
    assert not cpu_gemm.applies(x.bfloat16(), w.bfloat16())
    assert not cpu_gemm.applies(x, w.t().contiguous().t())                     # a transposed weight
    assert not cpu_gemm.applies(x, w, torch.randn(7))                          # a bias of the wrong length
    assert not cpu_gemm.applies(torch.randn(0, 32), w)
    wg = w.clone().requires_grad_()
    assert not cpu_gemm.applies(x, wg)
    y = cpu_gemm.linear(x, wg)
    y.sum().backward()                                                         # F.linear's gradient
    torch.testing.assert_close(wg.grad, x.sum(0).expand(8, 32))
    with torch.no_grad():
        assert cpu_gemm.applies(x, wg)


def test_the_model_layers_take_it():
    from engine.kernels.matmul.cpu_gemm import Linear
    layer = Linear(64, 32, bias=True)
    x = torch.randn(5, 64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert list(layer.state_dict()) == ["weight", "bias"]
