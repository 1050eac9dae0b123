"""engine.memory.kv_cache.kv_pages: zeroed K and V arrays per layer, on the CPU views of one lazily mapped buffer."""
import os

import pytest
import torch

from engine.memory.kv_cache import kv_pages


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pages_are_zero_separate_and_of_the_asked_shape(dtype):
    shape = (6, 16, 3, 64)
    pages = kv_pages(4, shape, dtype, "cpu")
    assert len(pages) == 4
    for k, v in pages:
        for t in (k, v):
            assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
            assert not t.any()
    pages[1][0][2, 5] = 1.5                     # one layer's K: nothing else changes
    touched = [(i, j) for i, kv in enumerate(pages) for j, t in enumerate(kv) if t.any()]
    assert touched == [(1, 0)]
    assert pages[1][0][2, 5].eq(1.5).all() and pages[1][0].ne(0).sum() == 3 * 64


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident size from Linux's /proc")
def test_cpu_pages_cost_no_memory_until_written():
    before = _resident_mib()
    pages = kv_pages(30, (2048, 16, 3, 64), torch.float32, "cpu")    # 1.5 GB: the default model's CPU engine
    pages[0][0][0].fill_(1.0)
    grew = _resident_mib() - before
    assert grew < 200, f"allocating the pages made {grew:.0f} MiB resident"
    assert pages[29][1][-1].abs().sum() == 0 and pages[0][0][0].sum() == 16 * 3 * 64


@pytest.mark.gpu
def test_cuda_pages_are_zero():
    pages = kv_pages(2, (4, 16, 2, 8), torch.bfloat16, "cuda")
    assert all(t.device.type == "cuda" and not t.any() for kv in pages for t in kv)
