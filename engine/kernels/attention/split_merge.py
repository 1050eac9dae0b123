"""The KV splits of the attention kernels (engine/kernels/attention/paged_attention.py, decode_attention.py): how
many a launch takes (split_count: given, or by a rule of grid and context bound), and their merge: a combine
kernel after the attention kernel, or (its `semaphores=`) the attention kernel itself (store_splits, the
programs' shared end). There each split program stores its partial (acc, max, sum) as before, then takes a
ticket from its (query block, sequence, kv head)'s counter; the program that takes the last one merges the
partials of all splits and resets the counter to 0 for the next launch (so a counter buffer stays zero between
kernels, CUDA graph replays included).

Ordering: a CTA barrier after the partial stores, then the ticket as one acq_rel atomic at GPU scope (release:
this CTA's partials are visible before the count says so; acquire: the last program sees every other's), and the
partials are read past L1 (.cg). The merge is the combine kernel's math (max, weights exp2(m - max), weighted sums)
over the splits in order; its sum order differs from the combine kernel's reduction, so fp32 results agree to
rounding.
"""
import operator

import torch
import triton
import triton.language as tl

from engine.kernels.attention.attention_checks import check_unit_stride
from engine.kernels.common import pdl, pdl_start, reduce_max, reduce_sum, sm_count

LONG_TILES = 32                # a context bound of this many KV tiles (2048 keys) splits a full grid


@triton.jit
def store_splits(acc, l_i, m_i, out_ptr, part_acc, part_m, part_l, sem_ptr, group_index, q_row, head, row_ok, offs_d,
                 d_ok, split, num_heads, stride_ot, stride_oh, NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                 HEAD_PAD: tl.constexpr, MERGE: tl.constexpr, active):
    """An attention program's end: its rows' output (one split), or its split's partials (acc, max, sum) and, with
    MERGE, the group's merge by its last program. q_row, head: each row's token and head [BLOCK_M]. active: the
    group's splits that hold keys, the first ones (active_splits; the others returned before this: MERGE only)."""
    out_off = q_row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # rows with no visible key (bad metadata) give 0, not NaN
        tl.store(out_ptr + out_off, (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
    else:
        row = (q_row * num_heads + head) * NUM_SPLITS + split
        tl.store(part_acc + row[:, None] * HEAD_PAD + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_m + row, m_i, mask=row_ok)
        tl.store(part_l + row, l_i, mask=row_ok)
        if MERGE:  # the group's last split program merges, no combine kernel
            merge_if_last(sem_ptr, group_index, part_acc, part_m, part_l, out_ptr, q_row * num_heads + head, row_ok,
                          out_off, offs_d, d_ok, NUM_SPLITS, BLOCK_M, HEAD_PAD, active)


@triton.jit
def merge_if_last(sem_ptr, index, part_acc, part_m, part_l, out_ptr, first, row_ok, out_off, offs_d, d_ok,
                  NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_PAD: tl.constexpr, active):
    """After this program stored its partials: take a ticket from counter `index`; the last of the group's
    `active` programs (its first splits) merges their partials into out[rows] and resets the counter. first
    [BLOCK_M]: each row's (token * num_heads + head); out_off: each row's out offsets [BLOCK_M, HEAD_PAD]; rows not
    `row_ok` are neither read nor written."""
    tl.debug_barrier()
    ticket = tl.atomic_add(sem_ptr + index, 1, sem="acq_rel", scope="gpu")
    if ticket == active - 1:
        _merge(part_acc, part_m, part_l, out_ptr, first, row_ok, out_off, offs_d, d_ok, NUM_SPLITS, BLOCK_M, HEAD_PAD,
               active)
        tl.atomic_xchg(sem_ptr + index, 0, sem="relaxed", scope="gpu")


@triton.jit
def _merge(part_acc, part_m, part_l, out_ptr, first, row_ok, out_off, offs_d, d_ok,
           NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_PAD: tl.constexpr, active):
    """The combine kernel's math for this program's rows over the first `active` splits, summed in order (an
    inactive split's partial is never read: it weighs 0, as the partial of a split without keys would)."""
    base = first * NUM_SPLITS
    m = tl.load(part_m + base[:, None] + tl.arange(0, NUM_SPLITS)[None, :],
                mask=row_ok[:, None] & (tl.arange(0, NUM_SPLITS) < active)[None, :], other=float("-inf"),
                cache_modifier=".cg")
    m_max = reduce_max(m, 1)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    acc = tl.zeros((BLOCK_M, HEAD_PAD), dtype=tl.float32)
    l_tot = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        ok = row_ok & ((first * 0 + s) < active)
        w = tl.exp2(tl.load(part_m + base + s, mask=ok, other=float("-inf"), cache_modifier=".cg") - m_safe)
        l_tot += w * tl.load(part_l + base + s, mask=ok, other=0.0, cache_modifier=".cg")
        acc += w[:, None] * tl.load(part_acc + (base + s)[:, None] * HEAD_PAD + offs_d[None, :],
                                    mask=ok[:, None], other=0.0, cache_modifier=".cg")
    o = acc / tl.where(l_tot == 0.0, 1.0, l_tot)[:, None]
    tl.store(out_ptr + out_off, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def combine_kernel(part_acc, part_m, part_l, out_ptr, cu_q, num_seqs, num_heads, stride_ot, stride_oh,
                   NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    """The splits' partials of token t, head h merged into out (tokens past the last sequence: untouched)."""
    pdl_start(USE_PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    if t >= tl.load(cu_q + num_seqs):  # rows past the last sequence stay untouched
        return
    row = (t * num_heads + h) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_PAD)
    m = tl.load(part_m + row)
    m_max = reduce_max(m, 0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    l_tot = reduce_sum(w * tl.load(part_l + row), 0)
    acc = reduce_sum(tl.load(part_acc + row[:, None] * HEAD_PAD + offs_d[None, :]) * w[:, None], 0)
    o = acc / tl.where(l_tot == 0.0, 1.0, l_tot)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def merges(num_splits: int, semaphores, groups: int, device) -> bool:
    """Whether a launch of `groups` groups split num_splits ways merges its splits in the kernel: with a semaphore
    buffer of a counter a group, and where its programs fit one an SM. A fuller grid keeps the combine kernel:
    merging there slowed 32-stream guided decoding's forward, in a load its bf16 outputs changed
    (docs/decode_step.md)."""
    if num_splits == 1 or semaphores is None or _check_semaphores(semaphores, device) < groups:
        return False
    if device.type != "cuda":
        return True
    return groups * num_splits <= sm_count(device)


def _check_semaphores(sem, device) -> int:
    """The counters a semaphore buffer holds (a split launch needing more merges in the combine kernel)."""
    if sem.dtype != torch.int32 or sem.dim() != 1 or sem.device != device:
        raise ValueError(f"semaphores must be a 1-D int32 tensor on {device}, got {sem.dim()}-D {sem.dtype} on "
                         f"{sem.device}")
    check_unit_stride("semaphores", sem)
    return sem.numel()


def split_partials(out, num_splits: int, head_pad: int):
    """(part_acc, part_m, part_l): fp32 buffers for each split's partial of every out row, or `out` as a
    placeholder for all three when there is one split (the kernel does not read them then)."""
    if num_splits == 1:
        return out, out, out
    num_tokens, num_heads = out.shape[:2]
    part_acc = torch.empty((num_tokens, num_heads, num_splits, head_pad), dtype=torch.float32, device=out.device)
    part_m, part_l = torch.empty((2, num_tokens, num_heads, num_splits), dtype=torch.float32,
                                 device=out.device).unbind(0)
    return part_acc, part_m, part_l


def combine_splits(part_acc, part_m, part_l, out, cu_seqlens_q, num_seqs: int, head_pad: int) -> None:
    """The combine kernel: every token's and head's split partials merged into out."""
    num_tokens, num_heads, head_dim = out.shape
    combine_kernel[(num_tokens, num_heads)](
        part_acc, part_m, part_l, out, cu_seqlens_q, num_seqs, num_heads, out.stride(0), out.stride(1),
        NUM_SPLITS=part_m.shape[-1], HEAD_DIM=head_dim, HEAD_PAD=head_pad,
        **pdl(combine_kernel, out.device, num_tokens))


def split_count(num_splits, device, groups: int, block_tables, block_size: int, max_seq_len, tile_n: int) -> int:
    """The KV splits of a launch of `groups` (query block, sequence, kv head) groups: num_splits as given (checked),
    or _auto_splits' for the context bound (max_seq_len, default the block tables' capacity)."""
    if num_splits is None:
        capacity = block_tables.shape[1] * block_size
        max_kv = capacity if max_seq_len is None else min(operator.index(max_seq_len), capacity)
        num_splits = _auto_splits(device, groups, max_kv, tile_n)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    return num_splits


def _auto_splits(device, programs: int, max_kv: int, tile_n: int) -> int:
    """KV splits (a power of two) for a grid of `programs` (query block, sequence, kv head) and a context bound.

    A grid under half an SM a program: splits until every SM has a program, rounded up to a power of two (so up to
    two an SM: an SM with two programs' loads in flight reads faster than with one), at most one per 2 tiles of the
    bound (at one stream even ~170-key contexts decode faster split 3 ways plus the merge than unsplit). A fuller grid
    splits only for long bounds (>= LONG_TILES tiles: the decode graphs of the model's whole context, eager long
    steps), up to ~3 programs an SM: several are resident on an SM at once. With SmolLM2's heads at 32-64 streams
    splits win at 1024 keys and lose at 256, so the 512-key graphs keep one (docs/decode_step.md)."""
    if device.type != "cuda":
        return 1
    sms = sm_count(device)
    tiles = triton.cdiv(max_kv, tile_n)
    if programs < sms // 2:
        want = triton.next_power_of_2(triton.cdiv(sms, programs))
    else:
        want = (3 * sms) // programs if tiles >= LONG_TILES else 1
    splits = min(32, want, tiles // 2)
    return 1 << (splits.bit_length() - 1) if splits > 1 else 1
