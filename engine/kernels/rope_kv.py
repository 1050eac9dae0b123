"""RoPE and the KV store of a step's new tokens inside engine/kernels/paged_attention.py's kernel (its `rope=`):
the same fp32 rotation and single rounding as engine/kernels/fused_ops.py's rope_store_kv, so both give the same
bits. Each is split in two: what reads only the step's metadata (positions, slots, the cos / sin tables), which the
attention kernel runs before it waits for the kernel before it, and what reads that kernel's q / k / v."""
import triton
import triton.language as tl

from engine.kernels.fused_ops import rotate_rows


@triton.jit
def rope_cos_sin(pos_ptr, rows, ok, cos_ptr, sin_ptr, stride_cos, offs_d, HEAD_DIM: tl.constexpr):
    """cos and sin [R, HEAD_PAD] at positions[rows] (rows not `ok`: 0)."""
    m = ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    pos = tl.load(pos_ptr + rows, mask=ok, other=0).to(tl.int64)
    c = tl.load(cos_ptr + pos[:, None] * stride_cos + offs_d[None, :], mask=m, other=0.0)
    s = tl.load(sin_ptr + pos[:, None] * stride_cos + offs_d[None, :], mask=m, other=0.0)
    return c, s


@triton.jit
def rope_rows(ptr, rows, heads, stride_t, stride_h, ok, c, s, offs_d, HEAD_DIM: tl.constexpr):
    """RoPE of x[rows, heads] in fp32 by rope_store_kv's rotation (fused_ops.rotate_rows), c / s from
    rope_cos_sin. Rows not `ok` give 0."""
    m = ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    return rotate_rows(ptr + rows.to(tl.int64)[:, None] * stride_t + heads[:, None] * stride_h, offs_d, m, c, s,
                       HEAD_DIM)


@triton.jit
def new_kv_slots(slot_ptr, pos_ptr, cos_ptr, sin_ptr, stride_cos, first, count, ctx, lo, hi, offs_d,
                 ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Metadata of the new tokens first .. first + count (cache positions ctx ..) whose positions fall in
    [lo, hi): (rows, ok, slot, cos, sin), row j of each for new token j; not ok: outside, or slot -1."""
    j = tl.arange(0, ROWS)
    rows = first + j
    ok = (j < count) & (ctx + j >= lo) & (ctx + j < hi)
    slot = tl.load(slot_ptr + rows, mask=ok, other=-1).to(tl.int64)
    ok = ok & (slot >= 0)
    c, s = rope_cos_sin(pos_ptr, rows, ok, cos_ptr, sin_ptr, stride_cos, offs_d, HEAD_DIM)
    return rows, ok, slot, c, s


@triton.jit
def store_new_kv(kn_ptr, vn_ptr, kc_ptr, vc_ptr, rows, ok, slot, c, s, stride_knt, stride_knh, stride_vnt,
                  stride_vnh, stride_pos, kv_off_head, kv_head, offs_d, HEAD_DIM: tl.constexpr):
    """The rotated keys and the values of kv head `kv_head` of new_kv_slots' rows to their cache slots; returns
    them [ROWS, HEAD_PAD] as stored (in the cache's dtype; rows not ok: 0)."""
    k = rope_rows(kn_ptr, rows, rows * 0 + kv_head, stride_knt, stride_knh, ok, c, s, offs_d, HEAD_DIM)
    k = k.to(kc_ptr.dtype.element_ty)
    m = ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    dst = slot[:, None] * stride_pos + kv_off_head + offs_d[None, :]
    tl.store(kc_ptr + dst, k, mask=m)
    v = tl.load(vn_ptr + rows.to(tl.int64)[:, None] * stride_vnt + kv_head * stride_vnh + offs_d[None, :], mask=m,
                other=0.0).to(vc_ptr.dtype.element_ty)
    tl.store(vc_ptr + dst, v, mask=m)
    return k, v
