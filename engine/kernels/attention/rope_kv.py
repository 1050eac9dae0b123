"""RoPE and the KV store of a step's new tokens inside engine/kernels/attention/paged_attention.py's kernel (its
`rope=`): the same fp32 rotation and single rounding as engine/kernels/fused_ops.py's rope_store_kv, so both give
the same bits."""
import triton
import triton.language as tl

from engine.kernels.fused_ops import rotate_rows


@triton.jit
def rope_tables(pos_ptr, cos_ptr, sin_ptr, rows, ok, stride_cos, offs_d, mask):
    """The cos / sin rows [R, HEAD_PAD] of the positions of tokens `rows` (zeros outside `mask`; rows not `ok`
    read position 0)."""
    pos = tl.load(pos_ptr + rows, mask=ok, other=0).to(tl.int64)
    c = tl.load(cos_ptr + pos[:, None] * stride_cos + offs_d[None, :], mask=mask, other=0.0)
    s = tl.load(sin_ptr + pos[:, None] * stride_cos + offs_d[None, :], mask=mask, other=0.0)
    return c, s


@triton.jit
def rope_rows(ptr, rows, heads, stride_t, stride_h, ok, pos_ptr, cos_ptr, sin_ptr, stride_cos, offs_d,
               HEAD_DIM: tl.constexpr):
    """RoPE of x[rows, heads] (each row at positions[row]) in fp32, by rope_store_kv's rotation
    (fused_ops.rotate_rows). Rows not `ok` give 0."""
    m = ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    c, s = rope_tables(pos_ptr, cos_ptr, sin_ptr, rows, ok, stride_cos, offs_d, m)
    return rotate_rows(ptr + rows.to(tl.int64)[:, None] * stride_t + heads[:, None] * stride_h, offs_d, m, c, s,
                       HEAD_DIM)


@triton.jit
def store_new_kv(kn_ptr, vn_ptr, kc_ptr, vc_ptr, slot_ptr, pos_ptr, cos_ptr, sin_ptr, stride_knt, stride_knh,
                  stride_vnt, stride_vnh, stride_cos, stride_pos, kv_off_head, kv_head, first, count, ctx, lo, hi,
                  offs_d, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The new tokens first .. first + count (cache positions ctx ..) whose positions fall in [lo, hi): their
    rotated keys and values of kv head `kv_head` to their cache slots (slot -1 writes nothing)."""
    j = tl.arange(0, ROWS)
    rows = first + j
    ok = (j < count) & (ctx + j >= lo) & (ctx + j < hi)
    slot = tl.load(slot_ptr + rows, mask=ok, other=-1).to(tl.int64)
    ok = ok & (slot >= 0)
    k = rope_rows(kn_ptr, rows, j * 0 + kv_head, stride_knt, stride_knh, ok, pos_ptr, cos_ptr, sin_ptr, stride_cos,
                   offs_d, HEAD_DIM)
    m = ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    dst = slot[:, None] * stride_pos + kv_off_head + offs_d[None, :]
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=m)
    v = tl.load(vn_ptr + rows.to(tl.int64)[:, None] * stride_vnt + kv_head * stride_vnh + offs_d[None, :], mask=m)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=m)
