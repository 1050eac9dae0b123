"""bench/kernels/decode_gemm.py: its config sweep reaches the kernel's launches."""
import json

import pytest
import torch

from bench.kernels import decode_gemm as bench
from conftest import triton_module


def test_sweep_configs_are_distinct_and_the_override_takes_every_argument():
    assert len({json.dumps(c, sort_keys=True) for c in bench.SWEEP}) == len(bench.SWEEP)
    gm = triton_module("matmul.decode_gemm")
    cfg = bench.SWEEP[-1]
    with bench.gemm_config(cfg):
        assert gm.decode_gemm_config(7, 576, 1536) == cfg
        assert gm.decode_gemm_config(7, 576, 1536, True) == cfg
    assert gm.decode_gemm_config(7, 576, 1536) != cfg


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter smoke run (CUDA times the real shapes)")
def test_quick_sweep_times_every_config_it_names():
    triton_module("matmul.decode_gemm")
    impls = bench.make_impls("o_proj", 7, 64, 64, 1, "cpu", torch.bfloat16)
    want = impls["ref"](0)
    best_us, best_cfg, timed = bench.sweep(impls["gemm"], want, lambda fn, calls, replays: fn(0) is not None,
                                           calls=1, replays=1, quick=True)
    quick = [c for c in bench.SWEEP if c["GROUPS"] == 1 and c["num_warps"] == 4]
    assert [cfg for _, cfg in timed] == quick
    assert best_cfg in quick
