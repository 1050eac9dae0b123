"""engine.kernels.attention.paged_attention against the torch reference (engine.attention).

Without CUDA the kernels run in the Triton CPU interpreter (tests/conftest.py: triton_module).
"""
import pytest
import torch

from conftest import triton_module
from engine.attention import AttentionMetadata, paged_attention_torch, store_kv_torch

ta = triton_module("attention.paged_attention")

DEV = "cpu" if ta.interpreted() else "cuda"
# Interpreter: float32 numpy matmuls, so only summation-order rounding (~1e-7); 1e-4 leaves headroom
# while any masking/indexing bug gives O(1). On a GPU float32 inputs take tl.dot's "ieee" precision
# (not TF32), so the same bound holds there.
TOL = 1e-4
gpu = pytest.mark.skipif(DEV != "cuda", reason="needs CUDA (kernels compiled, not interpreted)")


def make_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim=64, block_size=16, dtype=torch.float32,
               device=DEV, pad_rows=3, seed=0):
    """Random step: pages shuffled across sequences, cache slots past each sequence's end left NaN."""
    g = torch.Generator(device=device).manual_seed(seed)
    max_blocks = max(-(-s // block_size) for s in seq_lens) + 1
    num_blocks = len(seq_lens) * max_blocks + 3
    block_tables = torch.randperm(num_blocks, generator=g, device=device)[:len(seq_lens) * max_blocks]
    block_tables = block_tables.reshape(len(seq_lens), max_blocks).to(torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    for i, n in enumerate(seq_lens):
        pos = torch.arange(n, device=device)
        slots = block_tables[i, pos // block_size].long() * block_size + pos % block_size
        k, v = torch.randn(2, n, num_kv_heads, head_dim, generator=g, device=device)
        store_kv_torch(k, v, k_cache, v_cache, slots)
    cu = torch.tensor([0] + q_lens, device=device).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu[-1]) + pad_rows, num_heads, head_dim, generator=g, device=device).to(dtype)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, AttentionMetadata(None, cu, seq_lens_t, block_tables, max(q_lens), max(seq_lens))


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def check(q, k_cache, v_cache, meta, tol=TOL, max_query_len=None, num_splits=None, ref=None):
    scale = q.shape[-1] ** -0.5
    out = torch.full_like(q, float("nan"))  # catches rows the kernel forgets to write
    ta.paged_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, scale,
                       max_query_len or meta.max_query_len, out=out, num_splits=num_splits)
    if ref is None:
        ref = paged_attention_torch(q, k_cache, v_cache, meta, scale)
    n = int(meta.cu_seqlens_q[-1])
    assert not out[:n].isnan().any(), "unwritten or NaN rows"
    assert out[n:].isnan().all(), "rows past cu_seqlens_q[-1] were written"
    err = rel_err(out[:n], ref[:n])
    assert err < tol, f"relative error {err:.2e} >= {tol:.0e}"
    return out


def test_store_kv_matches_reference_and_skips_padding():
    kv = torch.randn(7, 2 * 3, 64, device=DEV)
    k, v = kv[:, :3], kv[:, 3:]  # strided views, as split from a fused projection
    slots = torch.tensor([5, -1, 17, 40, -1, 0, 63], device=DEV)
    caches = [torch.full((4, 16, 3, 64), float("nan"), dtype=torch.float16, device=DEV) for _ in range(4)]
    ta.store_kv(k, v, caches[0], caches[1], slots)
    store_kv_torch(k, v, caches[2], caches[3], slots)
    torch.testing.assert_close(caches[0], caches[2], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(caches[1], caches[3], rtol=0, atol=0, equal_nan=True)
    assert caches[0].isnan().sum() == caches[0].numel() - 5 * 3 * 64  # the -1 rows wrote nothing


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (9, 3)])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode(num_heads, num_kv_heads, num_splits):
    # Length 1, exact multiples of the page and of the KV tile; length 0 (a padding sequence: the
    # reference gives zeros, the kernel must too, not NaN, also through the split merge).
    seq_lens = [1, 16, 33, 64, 100, 0]
    batch = make_batch([1] * len(seq_lens), seq_lens, num_heads, num_kv_heads)
    check(*batch, num_splits=num_splits)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (9, 3)])
def test_prefill_without_cache(num_heads, num_kv_heads):
    lens = [37, 70, 5]
    check(*make_batch(lens, lens, num_heads, num_kv_heads))


@pytest.mark.parametrize("block_size", [8, 16])
def test_chunked_prefill_over_cached_prefix(block_size):
    # Prefixes of 45, 16 and 20 tokens cached. With 42 tokens per query block, the last sequence's second
    # block starts at position 62: its unmasked tiles must stop at key 0, not at 64 (off-by-one trap).
    # max_query_len is a loose bound, as the API allows.
    batch = make_batch([20, 33, 60], [65, 49, 80], 9, 3, block_size=block_size)
    check(*batch, max_query_len=64)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_mixed_decode_and_prefill(num_splits):
    # Decode rows, a fresh prompt, a sequence with no new tokens, a chunk over a prefix.
    batch = make_batch([1, 40, 0, 1, 17], [50, 40, 12, 64, 80], 9, 3)
    check(*batch, num_splits=num_splits)


def test_head_dim_not_power_of_two():
    check(*make_batch([1, 9], [30, 20], 4, 2, head_dim=80))


def test_nothing_to_do_leaves_output_untouched():
    q, k_cache, v_cache, meta = make_batch([0, 0], [5, 9], 2, 2)
    out = torch.full_like(q, float("nan"))
    ta.paged_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, 0.1, 0, out=out)
    ta.paged_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, 0.1, 4, out=out)
    assert out.isnan().all()


def test_invalid_inputs_raise_value_error():
    q, k_cache, v_cache, meta = make_batch([1], [5], 2, 2)
    args = (meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, 0.1, 1)
    cases = {
        "dtype": (q.half(), k_cache, v_cache),
        "head_dim": (q[..., :32], k_cache, v_cache),
        "contiguous": (q, k_cache.transpose(0, 1), v_cache.transpose(0, 1)),
        "must be \\[T": (q[0], k_cache, v_cache),
        "multiple of num_kv_heads": (torch.randn(1, 3, 64, device=DEV), k_cache, v_cache),
    }
    for match, tensors in cases.items():
        with pytest.raises(ValueError, match=match):
            ta.paged_attention(*tensors, *args)
    with pytest.raises(ValueError, match="host numbers"):
        ta.paged_attention(q, k_cache, v_cache, *args[:-1], torch.tensor(1))
    with pytest.raises(ValueError, match="slot_mapping"):
        ta.store_kv(q[:, :2], q[:, :2], k_cache, v_cache, torch.zeros(q.shape[0], device=DEV))


def test_strided_index_tensors_are_refused():
    """The kernels read entry i of cu_seqlens_q, seq_lens, slot_mapping and tree_masks at offset i: a column view
    ([N, w][:, j]) would be misread, so it is refused."""
    q, k_cache, v_cache, meta = make_batch([1, 2], [5, 9], 2, 2)
    slots = torch.arange(q.shape[0], device=DEV)
    col = {name: torch.stack([x, x], 1)[:, 0] for name, x in
           (("cu_seqlens_q", meta.cu_seqlens_q), ("seq_lens", meta.seq_lens), ("slot_mapping", slots))}
    with pytest.raises(ValueError, match="cu_seqlens_q must have unit stride"):
        ta.paged_attention(q, k_cache, v_cache, col["cu_seqlens_q"], meta.seq_lens, meta.block_tables, 0.1, 2)
    with pytest.raises(ValueError, match="seq_lens must have unit stride"):
        ta.paged_attention(q, k_cache, v_cache, meta.cu_seqlens_q, col["seq_lens"], meta.block_tables, 0.1, 2)
    masks = torch.ones(2, 2, dtype=torch.int64, device=DEV)[:, 0]
    with pytest.raises(ValueError, match="tree_masks must have unit stride"):
        ta.paged_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, 0.1, 2,
                           tree_masks=masks)
    with pytest.raises(ValueError, match="slot_mapping must have unit stride"):
        ta.store_kv(q, q, k_cache, v_cache, col["slot_mapping"])


# ---- GPU: real dtypes and sizes, CUDA graphs ------------------------------------------------------------

SHAPES = {"smollm": (9, 3, 64), "llama8b": (32, 8, 128)}
GPU_DTYPES = [torch.bfloat16, torch.float16]


def check_lowp(q_lens, seq_lens, shape, dtype, num_splits=None, seed=0):
    """Kernel in bf16/fp16 vs the reference on float32 upcasts of the same inputs."""
    q, k_cache, v_cache, meta = make_batch(q_lens, seq_lens, *shape, dtype=dtype, seed=seed)
    ref = paged_attention_torch(q.float(), k_cache.float(), v_cache.float(), meta, shape[2] ** -0.5)
    check(q, k_cache, v_cache, meta, tol=1e-2, num_splits=num_splits, ref=ref)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("batch,num_splits", [(32, None), (32, 1), (2, None), (2, 8)])
def test_gpu_decode(dtype, shape, batch, num_splits):
    g = torch.Generator().manual_seed(batch)
    seq_lens = [2048, 1, 16] + torch.randint(1, 2049, (max(batch - 3, 0),), generator=g).tolist()
    check_lowp([1] * batch, seq_lens[:batch], SHAPES[shape], dtype, num_splits)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gpu_prefill_chunked_and_mixed(dtype, shape):
    check_lowp([1024], [1024], SHAPES[shape], dtype)                      # fresh prompt
    check_lowp([512, 300], [1024, 700], SHAPES[shape], dtype)             # chunks over cached prefixes
    check_lowp([1, 5, 1000, 1, 0], [900, 40, 1000, 2048, 7], SHAPES[shape], dtype)  # mixed step
    check_lowp([5] * 8, [100 * i + 5 for i in range(8)], SHAPES[shape], dtype)  # speculative verify


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_store_kv(dtype):
    k, v = torch.randn(2, 300, 8, 128, device="cuda")
    slots = torch.randperm(64 * 16, device="cuda")[:300]
    slots[::7] = -1
    caches = [torch.zeros(64, 16, 8, 128, dtype=dtype, device="cuda") for _ in range(4)]
    ta.store_kv(k, v, caches[0], caches[1], slots)
    store_kv_torch(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1])
def test_gpu_cuda_graph_replay_with_new_metadata(num_splits):
    batch, shape, dtype = 8, SHAPES["llama8b"], torch.bfloat16
    q, k_cache, v_cache, meta = make_batch([1] * batch, [2048] * batch, *shape, dtype=dtype, pad_rows=0)
    cu, seq_lens, tables = meta.cu_seqlens_q, meta.seq_lens.clone(), meta.block_tables.clone()
    scale = shape[2] ** -0.5

    def step():
        return ta.paged_attention(q, k_cache, v_cache, cu, seq_lens, tables, scale, 1, num_splits=num_splits)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        seq_lens.copy_(torch.randint(1, 2049, (batch,), generator=g))
        tables.copy_(meta.block_tables[torch.randperm(batch, generator=g)])  # other sequences' pages
        q.copy_(torch.randn(q.shape, generator=g))
        graph.replay()
        new_meta = AttentionMetadata(None, cu, seq_lens, tables, 1, 2048)
        ref = paged_attention_torch(q.float(), k_cache.float(), v_cache.float(), new_meta, scale)
        assert rel_err(out, ref) < 1e-2
