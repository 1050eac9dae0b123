"""bench/step/graph_launch.py: the host time of graph replays by kernel count (CUDA only)."""
import json

import pytest
import torch

from bench.step import graph_launch


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal without a CUDA device")
def test_without_cuda_it_says_it_needs_a_cuda_device(tmp_path):
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        graph_launch.main(["--nodes", "4", "--out", str(tmp_path / "g.json")])


@pytest.mark.gpu
def test_replays_run_every_kernel_and_are_timed(tmp_path):
    out = tmp_path / "g.json"
    graph_launch.main(["--nodes", "4", "32", "--replays", "5", "--warmup", "2", "--out", str(out)])
    records = json.loads(out.read_text())
    assert {r["nodes"] for r in records} == {4, 32}
    assert all(0 < r["host_us"] <= r["gpu_us"] for r in records)
    with pytest.raises(ValueError, match="positive"):
        graph_launch.main(["--nodes", "0", "--out", str(out)])
