"""bench/kernels/head_mma.py: its interpreter smoke run (timing needs CUDA) and its sweep's configs."""
import json

import pytest
import torch

from bench.kernels import head_mma as bench
from conftest import triton_module


def test_sweep_covers_both_loops_and_preload_has_no_pipeline_stages():
    assert {c["PRELOAD"] for c in bench.SWEEP} == {False, True}
    assert all(c["num_stages"] == 1 for c in bench.SWEEP if c["PRELOAD"])
    assert len({json.dumps(c, sort_keys=True) for c in bench.SWEEP}) == len(bench.SWEEP)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter smoke run (CUDA times the real heads)")
def test_cpu_smoke_run_agrees_with_torch_and_writes_the_table(tmp_path):
    triton_module("matmul.head_mma")
    out = tmp_path / "h.json"
    bench.main(["--device", "cpu", "--rows", "1", "5", "--calls", "1", "--replays", "1", "--out", str(out)])
    records = json.loads(out.read_text())
    assert [r["rows"] for r in records] == [1, 5]
    for r in records:
        assert set(r["agree"]) == {"cublas", "mma", "gemv"} and set(r["agree"].values()) == {r["rows"]}
    assert "| tiny | 300 | 64 | 5 |" in (tmp_path / "h.md").read_text()
