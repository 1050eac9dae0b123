"""paged_attention(semaphores=...): the last split program of each (query block, sequence, kv head) merges the
splits itself, with the combine kernel's results, and leaves the counters zero for the next launch.

Without CUDA the kernels run in the Triton CPU interpreter (tests/conftest.py: triton_module).
"""
import pytest
import torch

from conftest import triton_module
from engine.attention import paged_attention_torch
from engine.kernels.attention import split_merge as sm
from test_rope_attention import make_step
from test_triton_attention import DEV, TOL, make_batch, rel_err

ta = triton_module("attention.paged_attention")


def run(q, k_cache, v_cache, meta, num_splits, semaphores=None, rope=None):
    out = torch.full_like(q, float("nan"))
    ta.paged_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, q.shape[-1] ** -0.5,
                       meta.max_query_len, out=out, num_splits=num_splits, semaphores=semaphores, rope=rope)
    return out


@pytest.mark.parametrize("num_splits", [2, 4, 8])
@pytest.mark.parametrize("q_lens,seq_lens", [([1, 1, 1], [37, 5, 70]), ([3, 1, 17], [40, 9, 17])],
                         ids=["decode", "mixed"])
def test_merged_in_kernel_equals_the_combine_kernel(q_lens, seq_lens, num_splits):
    q, k_cache, v_cache, meta = make_batch(q_lens, seq_lens, 9, 3)
    sem = torch.zeros(64, dtype=torch.int32, device=DEV)
    want = run(q, k_cache, v_cache, meta, num_splits)
    n = int(meta.cu_seqlens_q[-1])
    for _ in range(2):                                   # the counters reset: a second launch merges as well
        got = run(q, k_cache, v_cache, meta, num_splits, sem)
        assert not got[:n].isnan().any() and got[n:].isnan().all(), "rows unwritten, or written past the step"
        torch.testing.assert_close(got[:n], want[:n], rtol=1e-6, atol=1e-6)
        assert not sem.any(), "a counter was left nonzero"
    assert rel_err(got[:n], paged_attention_torch(q, k_cache, v_cache, meta, q.shape[-1] ** -0.5)[:n]) < TOL


def test_merge_with_rope_and_a_buffer_too_small():
    """With rope= as well; a buffer with fewer counters than groups falls back to the combine kernel."""
    s = make_step([1, 2, 1], [20, 33, 64], 9, 3, seed=3)
    rope = (s["k"], s["v"], s["positions"], s["cos"], s["sin"], s["slots"])
    outs = []
    for sem in (None, torch.zeros(64, dtype=torch.int32, device=DEV), torch.zeros(2, dtype=torch.int32, device=DEV)):
        kc, vc = s["k_cache"].clone(), s["v_cache"].clone()
        outs.append(ta.paged_attention(s["q"], kc, vc, s["cu"], s["seq_lens"], s["tables"], 0.125, s["max_q"],
                                       num_splits=4, rope=rope, semaphores=sem))
        assert sem is None or not sem.any()
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)
    assert torch.equal(outs[2], outs[0])


def test_bad_semaphores_raise():
    q, k_cache, v_cache, meta = make_batch([1], [30], 4, 2)
    with pytest.raises(ValueError, match="semaphores"):
        run(q, k_cache, v_cache, meta, 2, torch.zeros(8, dtype=torch.int64, device=DEV))
    with pytest.raises(ValueError, match="semaphores must have unit stride"):     # counter i read at offset i
        run(q, k_cache, v_cache, meta, 2, torch.zeros(8, 2, dtype=torch.int32, device=DEV)[:, 0])


def test_merged_only_where_the_programs_fit_one_an_sm(monkeypatch):
    monkeypatch.setattr(sm, "sm_count", lambda index: 132)
    monkeypatch.setattr(sm, "_check_semaphores", lambda sem, device: sem.numel())
    cuda, sem = torch.device("cuda", 0), torch.zeros(1024, dtype=torch.int32)
    assert sm.merges(32, sem, 3, cuda) and sm.merges(4, sem, 24, cuda)   # 1 and 8 streams: 96 programs
    assert not sm.merges(4, sem, 96, cuda)              # 32 streams at a long bound: 384 programs, combine kernel
    assert sm.merges(4, sem, 33, cuda) and not sm.merges(4, sem, 34, cuda)            # 132 programs, then 136
    assert not sm.merges(1, sem, 3, cuda) and not sm.merges(4, None, 3, cuda)         # nothing to merge, no buffer
    assert not sm.merges(4, torch.zeros(8, dtype=torch.int32), 24, cuda)              # a counter short a group
    assert sm.merges(4, sem, 96, torch.device("cpu"))   # the interpreter has no SMs: merged, as the tests above


def test_auto_splits_split_a_full_grid_only_over_long_contexts(monkeypatch):
    monkeypatch.setattr(sm, "sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)

    def splits(streams, keys):                     # SmolLM2 decode: 3 kv heads, one query block, 64-key tiles
        return sm._auto_splits(cuda, 3 * streams, keys, 64)
    assert [splits(1, k) for k in (128, 512, 8192)] == [1, 4, 32]          # a tile pair a split, at most 32
    assert [splits(8, k) for k in (256, 8192)] == [2, 8]                   # every SM a program, up to two
    assert [splits(16, k) for k in (1024, 8192)] == [4, 4]                 # 48 programs: 3 an SM's worth, so 4
    assert [splits(32, k) for k in (512, 2048, 8192)] == [1, 4, 4]         # full grid: long bounds only, ~3 an SM
    assert [splits(64, 8192), splits(128, 8192)] == [2, 1]
    assert sm._auto_splits(torch.device("cpu"), 3, 8192, 64) == 1
