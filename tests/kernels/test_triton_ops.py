"""engine.kernels.fused_ops against its torch references and the unfused engine.models.llama math.

Without CUDA the kernels run in the Triton CPU interpreter (tests/conftest.py: triton_module).
"""
import pytest
import torch
import torch.nn.functional as F

from conftest import triton_module
from engine.attention import store_kv_torch
from engine.models.llama import RMSNorm, apply_rope

ops = triton_module("fused_ops")

DEV = "cpu" if ops.interpreted() else "cuda"
FP32_TOL = dict(rtol=1e-6, atol=1e-6)
# The interpreter casts fp32 -> bf16 by truncation (triton/runtime/interpreter.py cast_impl), not RTNE as
# compiled kernels and torch do: there, each bf16 rounding may be one ulp off (fp16 uses numpy's RTNE).
BF16_ULPS = 4 if DEV == "cpu" else 2
# fp32 summation order or FMA may flip a rounding (one ulp), which a following weight multiply can carry
# into a second; 0 ulp in the common case.
ULP = {torch.bfloat16: dict(rtol=BF16_ULPS * 2 ** -7, atol=1e-5),
       torch.float16: dict(rtol=2 * 2 ** -10, atol=1e-5),
       torch.float32: dict(rtol=1e-5, atol=1e-6)}
# Bit-exact where the kernel rounds once from fp32 like torch, except for the interpreter's bf16 cast.
EXACT = {d: dict(rtol=0, atol=0) for d in ULP} | ({torch.bfloat16: ULP[torch.bfloat16]} if DEV == "cpu" else {})
# Fused (round once) vs unfused (round per op) in low precision: a few ulps.
LOOSE = {torch.bfloat16: dict(rtol=3e-2, atol=5e-2), torch.float16: dict(rtol=4e-3, atol=4e-3),
         torch.float32: dict(rtol=1e-5, atol=1e-5)}


def randn(*shape, seed, dtype=torch.float32, device=DEV):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=device).to(dtype)


def model_rms_norm(x, weight, eps):
    norm = RMSNorm(x.shape[1], eps).to(device=x.device, dtype=x.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        return norm(x)


def rope_case(T, Hq, Hkv, D, dtype=torch.float32, device=DEV, block_size=4, num_blocks=6, seed=0):
    """Fused qkv output split into strided q/k/v views, NaN-poisoned caches, a slot -1 row when T > 1."""
    qkv = randn(T, (Hq + 2 * Hkv) * D + 5, seed=seed, dtype=dtype, device=device)[:, 3:-2]  # strided rows
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    q, k, v = q.view(T, Hq, D), k.view(T, Hkv, D), v.view(T, Hkv, D)
    max_pos = 4096
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, device=device).float() / D))
    emb = torch.outer(torch.arange(max_pos, device=device).float(), inv).repeat(1, 2)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    positions = torch.randint(0, max_pos, (T,), generator=g, device=device)
    slots = torch.randperm(num_blocks * block_size, generator=g, device=device)[:T]
    if T > 1:
        slots[T // 2] = -1
    caches = [torch.full((num_blocks, block_size, Hkv, D), float("nan"), dtype=dtype, device=device)
              for _ in range(2)]
    return q, k, v, positions, emb.cos(), emb.sin(), caches[0], caches[1], slots


def rope_all(fn, case):
    q, k, v, pos, cos, sin, kc, vc, slots = case
    kc, vc = kc.clone(), vc.clone()
    return fn(q, k, v, pos, cos, sin, kc, vc, slots), kc, vc


def unfused_rope(case):
    """engine.models.llama's path: cos/sin rows cast to the dtype, apply_rope, store_kv_torch."""
    q, k, v, pos, cos_c, sin_c, kc, vc, slots = case
    kc, vc = kc.clone(), vc.clone()
    cos, sin = cos_c[pos].to(q.dtype), sin_c[pos].to(q.dtype)
    store_kv_torch(apply_rope(k, cos, sin), v, kc, vc, slots)
    return apply_rope(q, cos, sin), kc, vc


def assert_cache_close(got, want, slots, **tol):
    untouched = torch.ones(got.shape[0] * got.shape[1], dtype=torch.bool, device=got.device)
    untouched[slots[slots >= 0]] = False
    flat_got, flat_want = got.flatten(0, 1), want.flatten(0, 1)
    assert flat_got[untouched].isnan().all(), "a slot that was not written changed"
    assert not flat_got[~untouched].isnan().any()
    torch.testing.assert_close(flat_got[~untouched], flat_want[~untouched], **tol)


# ---- CPU (interpreter) or GPU: small shapes ----

@pytest.mark.parametrize("T,H", [(1, 8), (3, 24), (5, 64)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_fp32_matches_reference_and_model(T, H, with_residual):
    x, w, r = randn(T, H, seed=H), randn(H, seed=H + 1), randn(T, H, seed=H + 2)
    eps = 1e-5
    if with_residual:
        out, new_res = ops.rms_norm(x, w, eps, residual=r)
        ref_out, ref_res = ops.rms_norm_ref(x, w, eps, residual=r)
        torch.testing.assert_close(new_res, x + r, rtol=0, atol=0)
        torch.testing.assert_close(ref_res, x + r, rtol=0, atol=0)
        torch.testing.assert_close(out, model_rms_norm(x + r, w, eps), **FP32_TOL)
    else:
        out, ref_out = ops.rms_norm(x, w, eps), ops.rms_norm_ref(x, w, eps)
        torch.testing.assert_close(out, model_rms_norm(x, w, eps), **FP32_TOL)
        torch.testing.assert_close(ref_out, model_rms_norm(x, w, eps), rtol=0, atol=0)
    torch.testing.assert_close(out, ref_out, **FP32_TOL)
    assert out.dtype == x.dtype and out.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_low_precision_strided_rows(dtype):
    wide, w = randn(4, 40, seed=1, dtype=dtype), randn(24, seed=2, dtype=dtype)
    r = randn(4, 24, seed=3, dtype=dtype)
    x = wide[:, 8:32]  # rows with stride 40
    out, new_res = ops.rms_norm(x, w, 1e-6, residual=r)
    ref_out, ref_res = ops.rms_norm_ref(x, w, 1e-6, residual=r)
    torch.testing.assert_close(new_res, x + r, **EXACT[dtype])  # torch's add also rounds once from fp32
    torch.testing.assert_close(out, ref_out, **ULP[dtype])
    torch.testing.assert_close(ref_out, model_rms_norm(x + r, w, 1e-6), rtol=0, atol=0)


@pytest.mark.parametrize("T,Hq,Hkv,D", [(1, 3, 1, 8), (4, 2, 2, 24), (5, 3, 1, 64)])
def test_rope_store_kv_fp32_matches_reference_and_model(T, Hq, Hkv, D):
    case = rope_case(T, Hq, Hkv, D, seed=D)
    assert T == 1 or case[0].stride(0) == case[1].stride(0) == (Hq + 2 * Hkv) * D + 5  # views into fused qkv
    (q, kc, vc), (rq, rkc, rvc), (uq, ukc, uvc) = (rope_all(ops.rope_store_kv, case),
                                                   rope_all(ops.rope_store_kv_ref, case), unfused_rope(case))
    slots = case[-1]
    assert q.shape == (T, Hq, D) and q.is_contiguous() and q.dtype == torch.float32
    torch.testing.assert_close(q, rq, **FP32_TOL)
    torch.testing.assert_close(q, uq, **FP32_TOL)
    for got, ref, unf in ((kc, rkc, ukc), (vc, rvc, uvc)):
        assert_cache_close(got, ref, slots, **FP32_TOL)
        assert_cache_close(got, unf, slots, **FP32_TOL)
        assert_cache_close(ref, unf, slots, **FP32_TOL)
    # v is copied bit for bit
    valid = slots >= 0
    torch.testing.assert_close(vc.flatten(0, 1)[slots[valid]], case[2][valid], rtol=0, atol=0)


def check_rope_low_precision(case, dtype):
    """Kernel vs its reference to a few ulps; vs the unfused model math loosely; v copied exactly."""
    (q, kc, vc), (rq, rkc, rvc), (uq, ukc, _uvc) = (rope_all(ops.rope_store_kv, case),
                                                   rope_all(ops.rope_store_kv_ref, case), unfused_rope(case))
    torch.testing.assert_close(q, rq, **ULP[dtype])
    torch.testing.assert_close(q, uq, **LOOSE[dtype])
    assert_cache_close(kc, rkc, case[-1], **ULP[dtype])
    assert_cache_close(kc, ukc, case[-1], **LOOSE[dtype])
    assert_cache_close(vc, rvc, case[-1], **EXACT[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_store_kv_low_precision(dtype):
    case = rope_case(5, 3, 1, 24, dtype=dtype, seed=7)
    check_rope_low_precision(case, dtype)


def test_rope_store_kv_all_padding_rows_write_nothing():
    q, k, v, pos, cos, sin, kc, vc, slots = rope_case(3, 2, 1, 16, seed=3)
    slots = torch.full_like(slots, -1)
    out = ops.rope_store_kv(q, k, v, pos, cos, sin, kc, vc, slots)
    assert kc.isnan().all() and vc.isnan().all()
    torch.testing.assert_close(out, ops.rope_store_kv_ref(q, k, v, pos, cos, sin, kc, vc, slots), **FP32_TOL)


@pytest.mark.parametrize("T,inter", [(1, 8), (3, 24), (5, 64)])
def test_silu_mul_fp32_matches_reference_and_model(T, inter):
    gate_up = randn(T, 2 * inter, seed=inter) * 4
    out = ops.silu_mul(gate_up)
    gate, up = gate_up.split(inter, dim=-1)
    assert out.shape == (T, inter) and out.dtype == torch.float32
    torch.testing.assert_close(out, ops.silu_mul_ref(gate_up), **FP32_TOL)
    torch.testing.assert_close(out, F.silu(gate) * up, **FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_mul_low_precision(dtype):
    gate_up = randn(3, 48, seed=5, dtype=dtype)
    gate, up = gate_up.split(24, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), ops.silu_mul_ref(gate_up), **ULP[dtype])
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up, **LOOSE[dtype])


def test_empty_batch():
    x, w = randn(0, 16, seed=0), randn(16, seed=1)
    assert ops.rms_norm(x, w, 1e-5).shape == (0, 16)
    assert ops.silu_mul(randn(0, 16, seed=2)).shape == (0, 8)
    q, k, v, pos, cos, sin, kc, vc, slots = rope_case(1, 2, 1, 8)
    assert ops.rope_store_kv(q[:0], k[:0], v[:0], pos[:0], cos, sin, kc, vc, slots[:0]).shape == (0, 2, 8)
    assert kc.isnan().all()


def test_rms_norm_bad_inputs():
    x, w = randn(2, 16, seed=0), randn(16, seed=1)
    bad = [
        (TypeError, "must be a torch.Tensor", lambda: ops.rms_norm(x.tolist(), w, 1e-5)),
        (ValueError, "2-D", lambda: ops.rms_norm(x[0], w, 1e-5)),
        (TypeError, "dtype must be", lambda: ops.rms_norm(x.double(), w.double(), 1e-5)),
        (TypeError, "weight dtype", lambda: ops.rms_norm(x, w.half(), 1e-5)),
        (ValueError, "weight has 8", lambda: ops.rms_norm(x, w[:8], 1e-5)),
        (ValueError, "unit stride", lambda: ops.rms_norm(x.t().contiguous().t()[:, :2], w[:2], 1e-5)),
        (TypeError, "eps", lambda: ops.rms_norm(x, w, torch.tensor(1e-5))),
        (ValueError, "residual shape", lambda: ops.rms_norm(x, w, 1e-5, residual=x[:1])),
        (TypeError, "residual dtype", lambda: ops.rms_norm(x, w, 1e-5, residual=x.half())),
    ]
    for exc, match, call in bad:
        with pytest.raises(exc, match=match):
            call()


def test_rope_store_kv_bad_inputs():
    case = rope_case(2, 2, 1, 8)
    q, k, v, pos, cos, sin, kc, vc, slots = case

    def call(**kw):
        args = dict(q=q, k=k, v=v, positions=pos, cos_cache=cos, sin_cache=sin, k_cache=kc, v_cache=vc,
                    slot_mapping=slots)
        return ops.rope_store_kv(**{**args, **kw})

    bad = [
        (ValueError, "q must be 3-D", dict(q=q[0])),
        (TypeError, "k dtype", dict(k=k.half())),
        (ValueError, "v shape", dict(v=v[:1])),
        (TypeError, "cos_cache dtype", dict(cos_cache=cos.half())),
        (ValueError, "sin_cache shape", dict(sin_cache=sin[:5])),
        (ValueError, "sin_cache's row stride", dict(sin_cache=torch.cat([sin, sin], 1)[:, :sin.shape[1]])),
        (ValueError, "k_cache must be contiguous", dict(k_cache=kc.transpose(0, 1))),
        (ValueError, "v_cache shape", dict(v_cache=vc[:2])),
        (TypeError, "slot_mapping dtype", dict(slot_mapping=slots.float())),
        (ValueError, "positions must be 1-D", dict(positions=pos[None])),
        (ValueError, "disagree on T", dict(slot_mapping=slots[:1])),
        (ValueError, "head_dim must be even", dict(q=randn(2, 2, 7, seed=0))),
        (ValueError, "kv heads", dict(k=randn(2, 2, 8, seed=0), v=randn(2, 2, 8, seed=1))),
        (ValueError, "unit stride", dict(q=q.transpose(1, 2).contiguous().transpose(1, 2))),
    ]
    for exc, match, kw in bad:
        with pytest.raises(exc, match=match):
            call(**kw)
    assert kc.isnan().all() and vc.isnan().all()


def test_silu_mul_bad_inputs():
    with pytest.raises(ValueError, match="must be even"):
        ops.silu_mul(randn(2, 7, seed=0))
    with pytest.raises(ValueError, match="2-D"):
        ops.silu_mul(randn(8, seed=0))
    with pytest.raises(TypeError, match="dtype must be"):
        ops.silu_mul(randn(2, 8, seed=0).to(torch.int32))


# ---- GPU: realistic shapes, compiled kernels ----

gpu = pytest.mark.skipif(DEV != "cuda", reason="needs CUDA (kernels compiled, not interpreted)")
GPU_DTYPES = [torch.bfloat16, torch.float32]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("H", [576, 2048, 4096, 8192])
@pytest.mark.parametrize("T", [1, 7, 64])
def test_gpu_rms_norm(dtype, H, T):
    x, w, r = randn(T, H, seed=H, dtype=dtype), randn(H, seed=T, dtype=dtype), randn(T, H, seed=1, dtype=dtype)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), ops.rms_norm_ref(x, w, 1e-5), **ULP[dtype])
    out, new_res = ops.rms_norm(x, w, 1e-5, residual=r)
    ref_out, ref_res = ops.rms_norm_ref(x, w, 1e-5, residual=r)
    torch.testing.assert_close(new_res, ref_res, **EXACT[dtype])
    torch.testing.assert_close(out, ref_out, **ULP[dtype])
    torch.testing.assert_close(out, model_rms_norm(x + r, w, 1e-5), **ULP[dtype])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("Hq,Hkv,D", [(9, 3, 64), (32, 8, 128)])
@pytest.mark.parametrize("T", [1, 5, 64])
def test_gpu_rope_store_kv(dtype, Hq, Hkv, D, T):
    case = rope_case(T, Hq, Hkv, D, dtype=dtype, device="cuda", block_size=16, num_blocks=8, seed=T)
    check_rope_low_precision(case, dtype)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("inter", [1536, 8192, 14336])
@pytest.mark.parametrize("T", [1, 64])
def test_gpu_silu_mul(dtype, inter, T):
    gate_up = randn(T, 2 * inter, seed=inter, dtype=dtype) * 3
    gate, up = gate_up.split(inter, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), ops.silu_mul_ref(gate_up), **ULP[dtype])
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up, **LOOSE[dtype])


@pytest.mark.gpu
@gpu
def test_gpu_ops_capture_in_cuda_graph():
    x, w, r = randn(4, 576, seed=0), randn(576, seed=1), randn(4, 576, seed=2)
    x, w, r = x.cuda(), w.cuda(), r.cuda()
    gate_up = randn(4, 3072, seed=3, device="cuda")
    case = rope_case(4, 9, 3, 64, device="cuda", block_size=16, num_blocks=4)
    q, k, v, pos, cos, sin, kc, vc, slots = case
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):  # warm-up compiles outside the capture
        ops.rms_norm(x, w, 1e-5, residual=r), ops.silu_mul(gate_up), ops.rope_store_kv(*case)
    torch.cuda.synchronize()
    kc.fill_(float("nan")), vc.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, new_res = ops.rms_norm(x, w, 1e-5, residual=r)
        act = ops.silu_mul(gate_up)
        q_rot = ops.rope_store_kv(*case)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, ops.rms_norm_ref(x, w, 1e-5, residual=r)[0], **ULP[torch.float32])
    torch.testing.assert_close(act, ops.silu_mul_ref(gate_up), **ULP[torch.float32])
    ref_q, ref_kc, _ = rope_all(ops.rope_store_kv_ref, (q, k, v, pos, cos, sin, kc.clone().fill_(float("nan")),
                                                        vc.clone().fill_(float("nan")), slots))
    torch.testing.assert_close(q_rot, ref_q, **ULP[torch.float32])
    assert_cache_close(kc, ref_kc, slots, **ULP[torch.float32])
