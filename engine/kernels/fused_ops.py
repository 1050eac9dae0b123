"""Fused Triton kernels for the decode step: RMSNorm (+ residual add), RoPE + KV-cache store, SiLU-and-mul.

Each replaces a chain of small torch kernels with one launch. Grids and constexprs depend only on shapes,
never on device data, so every entry point can be captured in a CUDA graph. Each has a pure-torch twin
(`*_ref`) with the same semantics, for devices without Triton and as the test oracle.

Rounding: rms_norm rounds exactly where engine.models.llama.RMSNorm does, so it agrees with it up to the order of
the fp32 sum. rope_store_kv and silu_mul compute in fp32 and round once to the output dtype; the unfused
bf16/fp16 path rounds after every op (and RoPE multiplies by cos/sin already rounded to the dtype), so the
two differ by rounding only (a few ulps of the dtype); in fp32 they agree to ~1e-7.
"""
from __future__ import annotations

import numbers

import torch
import triton
import triton.language as tl

from engine.kernels.common import is_interpreted, pdl, pdl_start, reduce_sum

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_MAX_ROW = 65536  # rms_norm keeps a whole row in registers; efficient up to ~8192


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, res_ptr, out_ptr, new_res_ptr, stride_x, stride_res, stride_out,
                     stride_new_res, n_cols, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                     USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    h = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=ok, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_res_ptr + row * stride_new_res + cols, h, mask=ok)
    # The norm reads the residual as rounded to the dtype, exactly as the unfused x = x + f(x); norm(x).
    tl.store(out_ptr + row * stride_out + cols, rms_norm_row(h, w_ptr, cols, ok, n_cols, eps, out_ptr.dtype.element_ty),
             mask=ok)


@triton.jit
def rms_norm_row(h, w_ptr, cols, ok, n_cols, eps, DTYPE: tl.constexpr):
    """RMSNorm of one row h [BLOCK] (columns `cols`, `ok` of them real) with weight w_ptr, rounded to DTYPE where
    engine.models.llama.RMSNorm rounds (rms_norm's kernel, and engine/kernels/speculative/head_ops.py's)."""
    hf = h.to(tl.float32)
    inv = tl.rsqrt(reduce_sum(hf * hf, 0) / n_cols + eps)
    normed = (hf * inv).to(DTYPE)  # rounded before the weight multiply, like RMSNorm
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    # bf16/fp16 products are exact in fp32, so this rounds like torch's same-dtype multiply.
    return (w.to(tl.float32) * normed.to(tl.float32)).to(DTYPE)


@triton.jit
def rotate_rows(base, offs_d, mask, c, s, HEAD_DIM: tl.constexpr):
    """x * cos + rotate_half(x) * sin in fp32 for the rows whose pointers are base [R, 1] (rope_store_kv's kernel,
    and engine/kernels/attention/rope_kv.py's): rotate_half(x)[d] = sign[d] * x[partner[d]]; c, s broadcast to
    [R, D]."""
    half = HEAD_DIM // 2
    partner = tl.where(offs_d < HEAD_DIM, tl.where(offs_d < half, offs_d + half, offs_d - half), 0)  # masked lanes
    sign = tl.where(offs_d < half, -1.0, 1.0)                                                      # stay in range
    x = tl.load(base + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(base + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    return x * c + sign[None, :] * xp * s


@triton.jit
def _rotate(ptr, stride_h, n_heads, c, s, offs_h, offs_d, HEAD_DIM: tl.constexpr):
    """The heads of one token, at one position (c, s: [D])."""
    ok = (offs_h[:, None] < n_heads) & (offs_d[None, :] < HEAD_DIM)
    return rotate_rows(ptr + offs_h[:, None] * stride_h, offs_d, ok, c[None, :], s[None, :], HEAD_DIM), ok


@triton.jit
def _rope_store_kv_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr, q_out_ptr,
                          stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos,
                          stride_slot, stride_ch, stride_qot, stride_qoh, n_q_heads, n_kv_heads,
                          HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, HQ_PAD: tl.constexpr,
                          HKV_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_DIM
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=d_ok, other=0.0)
    s = tl.load(sin_ptr + pos * stride_cos + offs_d, mask=d_ok, other=0.0)

    offs_hq = tl.arange(0, HQ_PAD)
    q, q_ok = _rotate(q_ptr + t * stride_qt, stride_qh, n_q_heads, c, s, offs_hq, offs_d, HEAD_DIM)
    tl.store(q_out_ptr + t * stride_qot + offs_hq[:, None] * stride_qoh + offs_d[None, :],
             q.to(q_out_ptr.dtype.element_ty), mask=q_ok)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # -1: padding row, its q is still rotated but nothing is cached
        offs_hk = tl.arange(0, HKV_PAD)
        k, kv_ok = _rotate(k_ptr + t * stride_kt, stride_kh, n_kv_heads, c, s, offs_hk, offs_d, HEAD_DIM)
        dst = slot * stride_slot + offs_hk[:, None] * stride_ch + offs_d[None, :]
        tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=kv_ok)
        v = tl.load(v_ptr + t * stride_vt + offs_hk[:, None] * stride_vh + offs_d[None, :], mask=kv_ok)
        tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=kv_ok)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_out, inter, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=ok, other=0.0).to(tl.float32)
    out = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def interpreted() -> bool:
    """True when the kernels were built for the Triton CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return is_interpreted(_rms_norm_kernel)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _check_tensor(name, x, dim, dtypes, device=None):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(x.shape)}")
    if x.dtype not in dtypes:
        raise TypeError(f"{name} dtype must be one of {[str(d) for d in dtypes]}, got {x.dtype}")
    if device is not None and x.device != device:
        raise ValueError(f"{name} is on {x.device}, expected {device}")
    if x.dim() and x.stride(-1) != 1 and x.shape[-1] > 1:
        raise ValueError(f"{name} must have unit stride in its last dim, got strides {x.stride()}")


def _check_device(device):
    if device.type != "cuda" and not interpreted():
        raise ValueError(f"tensors on {device} need a CUDA device or the Triton interpreter (TRITON_INTERPRET=1 "
                         "before triton is imported)")


def _check_same(name, x, ref_name, ref, shape=True, dtype=True):
    if shape and x.shape != ref.shape:
        raise ValueError(f"{name} shape {tuple(x.shape)} != {ref_name} shape {tuple(ref.shape)}")
    if dtype and x.dtype != ref.dtype:
        raise TypeError(f"{name} dtype {x.dtype} != {ref_name} dtype {ref.dtype}")


def _check_entries(name, x, n, dtypes, device):
    """A step's 1-D tensor (ids, rows): 1-D of `dtypes` on `device`, holding at least the n entries the step uses."""
    _check_tensor(name, x, 1, dtypes, device)
    if x.shape[0] < n:
        raise ValueError(f"{name} has {x.shape[0]} entries, the step uses {n}")


def rms_norm(x, weight, eps, residual=None):
    """RMSNorm of x [T, H] with weight [H] (same dtype as x), as engine.models.llama.RMSNorm.

    out = weight * (h.float() * rsqrt(mean(h.float()^2) + eps)).to(dtype), the product in x.dtype, where
    h = x, or with residual [T, H]: h = (x.float() + residual.float()).to(dtype), returned as
    (out, h) so that h is the next layer's residual. Rows may be strided; new tensors are returned.
    """
    _check_tensor("x", x, 2, _FLOAT_DTYPES)
    _check_tensor("weight", weight, 1, _FLOAT_DTYPES, x.device)
    _check_same("weight", weight, "x", x, shape=False)
    if weight.shape[0] != x.shape[1]:
        raise ValueError(f"weight has {weight.shape[0]} elements, x rows have {x.shape[1]}")
    if isinstance(eps, torch.Tensor) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a host float, got {type(eps).__name__}")
    if residual is not None:
        _check_tensor("residual", residual, 2, _FLOAT_DTYPES, x.device)
        _check_same("residual", residual, "x", x)
    n_rows, n_cols = x.shape
    if n_cols > _MAX_ROW:
        raise ValueError(f"rms_norm supports rows of up to {_MAX_ROW} elements, got {n_cols}")
    _check_device(x.device)
    out = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    new_res = torch.empty_like(out) if residual is not None else out
    if n_rows and n_cols:
        block = _pow2(n_cols)
        res = residual if residual is not None else x
        _rms_norm_kernel[(n_rows,)](
            x, weight, res, out, new_res, x.stride(0), res.stride(0), out.stride(0), new_res.stride(0),
            n_cols, float(eps), HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=4 if block <= 1024 else 8 if block <= 4096 else 16, **pdl(_rms_norm_kernel, x.device, n_rows))
    return out if residual is None else (out, new_res)


def rms_norm_ref(x, weight, eps, residual=None):
    """Pure-torch rms_norm (same semantics, any device)."""
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    hf = h.float()
    out = weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out if residual is None else (out, h)


def check_rope(q, k, v, positions, cos_cache, sin_cache, k_cache, v_cache, slot_mapping):
    _check_tensor("q", q, 3, _FLOAT_DTYPES)
    dev, (n_tokens, _, head_dim) = q.device, q.shape
    for name, x in (("k", k), ("v", v)):
        _check_tensor(name, x, 3, _FLOAT_DTYPES, dev)
        _check_same(name, x, "q", q, shape=False)
    _check_same("v", v, "k", k, dtype=False)
    for name, c in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        _check_tensor(name, c, 2, (torch.float32,), dev)
        _check_same(name, c, "cos_cache", cos_cache, dtype=False)
    if sin_cache.stride(0) != cos_cache.stride(0):      # the kernels read both at cos_cache's row stride
        raise ValueError(f"sin_cache's row stride {sin_cache.stride(0)} != cos_cache's {cos_cache.stride(0)}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(name, c, 4, _FLOAT_DTYPES, dev)
        _check_same(name, c, "k_cache", k_cache)
        if not c.is_contiguous():
            raise ValueError(f"{name} must be contiguous [num_blocks, block_size, num_kv_heads, head_dim]")
    for name, idx in (("positions", positions), ("slot_mapping", slot_mapping)):
        _check_tensor(name, idx, 1, _INDEX_DTYPES, dev)
    if head_dim % 2 or k.shape[2] != head_dim or cos_cache.shape[1] != head_dim or k_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim must be even and agree: q {head_dim}, k {k.shape[2]}, cos_cache "
                         f"{cos_cache.shape[1]}, k_cache {k_cache.shape[3]}")
    if k.shape[1] != k_cache.shape[2]:
        raise ValueError(f"k has {k.shape[1]} kv heads, k_cache {k_cache.shape[2]}")
    if not (k.shape[0] == positions.shape[0] == slot_mapping.shape[0] == n_tokens):
        raise ValueError(f"q, k, v, positions, slot_mapping disagree on T: {n_tokens}, {k.shape[0]}, "
                         f"{v.shape[0]}, {positions.shape[0]}, {slot_mapping.shape[0]}")
    if head_dim > 256:
        raise ValueError(f"head_dim up to 256 is supported, got {head_dim}")


def rope_store_kv(q, k, v, positions, cos_cache, sin_cache, k_cache, v_cache, slot_mapping):
    """RoPE (HF rotate_half, engine.models.llama.apply_rope) on q [T, Hq, D] and k [T, Hkv, D]; cache rotated k and v.

    cos/sin are rows `positions` of the float32 [max_pos, D] caches; the rotation runs in fp32 and is
    rounded once (q to q.dtype, k to k_cache.dtype). Rotated k and v go to flat cache slot slot_mapping[t]
    (block * block_size + offset); slot -1 writes nothing. q/k/v may be strided views (unit stride in D).
    Returns the rotated q as a new contiguous [T, Hq, D] tensor. Positions are not range-checked (no sync).
    """
    check_rope(q, k, v, positions, cos_cache, sin_cache, k_cache, v_cache, slot_mapping)
    _check_device(q.device)
    n_tokens, n_q_heads, head_dim = q.shape
    n_kv_heads = k.shape[1]
    q_out = torch.empty((n_tokens, n_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if n_tokens == 0:
        return q_out
    _rope_store_kv_kernel[(n_tokens,)](
        q, k, v, positions, cos_cache, sin_cache, k_cache, v_cache, slot_mapping, q_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), q_out.stride(0), q_out.stride(1), n_q_heads, n_kv_heads,
        HEAD_DIM=head_dim, HEAD_PAD=_pow2(head_dim), HQ_PAD=_pow2(n_q_heads), HKV_PAD=_pow2(n_kv_heads),
        num_warps=4 if n_q_heads * head_dim <= 4096 else 8, **pdl(_rope_store_kv_kernel, q.device, n_tokens))
    return q_out


def _rope_fp32(x, cos, sin):
    x = x.float()
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None, :] + torch.cat((-x2, x1), dim=-1) * sin[:, None, :]


def rope_store_kv_ref(q, k, v, positions, cos_cache, sin_cache, k_cache, v_cache, slot_mapping):
    """Pure-torch rope_store_kv (same semantics, any device)."""
    cos, sin = cos_cache[positions], sin_cache[positions]
    q_out = _rope_fp32(q, cos, sin).to(q.dtype)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    k_rot = _rope_fp32(k[valid], cos[valid], sin[valid]).to(k_cache.dtype)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k_rot)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[valid].to(v_cache.dtype))
    return q_out


def silu_mul(gate_up):
    """gate_up [T, 2*I] (gate first, then up) -> [T, I] = silu(gate) * up, in fp32, rounded once."""
    _check_tensor("gate_up", gate_up, 2, _FLOAT_DTYPES)
    n_rows, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up's last dim must be even (gate and up halves), got {width}")
    _check_device(gate_up.device)
    inter = width // 2
    out = torch.empty((n_rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if n_rows and inter:
        block = min(1024, _pow2(inter))
        _silu_mul_kernel[(n_rows, triton.cdiv(inter, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4,
            **pdl(_silu_mul_kernel, gate_up.device, n_rows))
    return out


def silu_mul_ref(gate_up):
    """Pure-torch silu_mul (same semantics, any device)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)
