"""The split-K launch of stream_gemm.py: a tile's K split over SPLITS programs, whose fp32 partials the tile's last
program to finish sums (as the KV splits of the attention kernels merge, engine/kernels/attention/split_merge.py).

Partials: one slot a (split, tile), [split * tiles + tile], each the tile's [BLOCK_N, BLOCK_M] product and a row of
its token rows' sums of squares ([BLOCK_N + 1, BLOCK_M] fp32). Counters: one a tile, zero between launches: the
program that sums a tile resets its counter, CUDA graph replays included.
"""
import triton
import triton.language as tl


@triton.jit
def store_partial(acc, ss, part_ptr, cnt_ptr, pid, split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This split's product and sums of squares into its slot of the partials, then a ticket from the tile's
    counter: a CTA barrier after the stores, the ticket one acq_rel atomic at GPU scope (release: the partial is
    visible before the count says so; acquire: the last program sees every other's)."""
    tiles = tl.num_programs(0)
    slot = split * tiles + pid
    tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    tl.store(part_ptr + slot * (BLOCK_N + 1) * BLOCK_M + tile, acc)
    tl.store(part_ptr + (slot * (BLOCK_N + 1) + BLOCK_N) * BLOCK_M + tl.arange(0, BLOCK_M), ss)
    tl.debug_barrier()
    return tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")


@triton.jit
def sum_partials(part_ptr, cnt_ptr, pid, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr):
    """The tile's product and sums of squares over its splits, in split order (whichever program sums them), read
    past L1; the counter back to 0 for the next launch (CUDA graph replays included)."""
    tiles = tl.num_programs(0)
    tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for split in tl.static_range(SPLITS):
        slot = split * tiles + pid
        acc += tl.load(part_ptr + slot * (BLOCK_N + 1) * BLOCK_M + tile, cache_modifier=".cg")
        ss += tl.load(part_ptr + (slot * (BLOCK_N + 1) + BLOCK_N) * BLOCK_M + tl.arange(0, BLOCK_M),
                      cache_modifier=".cg")
    tl.atomic_xchg(cnt_ptr + pid, 0, sem="relaxed", scope="gpu")
    return acc, ss
