"""bench/kernels/boundary.py: a kernel boundary against a grid-wide barrier (CUDA only; the barrier cannot run
interpreted, where a grid's programs run one after another)."""
import json

import pytest
import torch

from bench.kernels import boundary


@pytest.mark.parametrize("flag, value, match", [("--phases", "3", "even"), ("--phases", "0", "even"),
                                                ("--grids", "0", "positive"), ("--elems", "100", "powers of two"),
                                                ("--elems", "8", "powers of two")])
def test_bad_arguments_are_refused_by_name(flag, value, match):
    with pytest.raises(ValueError, match=match):
        boundary.check_args(boundary.parse_args([flag, value]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal without a CUDA device")
def test_without_cuda_it_says_it_needs_a_cuda_device(tmp_path):
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        boundary.main(["--grids", "2", "--out", str(tmp_path / "b.json")])


@pytest.mark.gpu
def test_every_mode_runs_every_phase_across_programs(tmp_path):
    """main checks each mode's last buffer against the phase count: a barrier that let a program run ahead would
    read its neighbour's stale part and fail that check."""
    out = tmp_path / "b.json"
    boundary.main(["--grids", "1", "132", "264", "--phases", "40", "--elems", "64", "--replays", "3",
                   "--out", str(out)])
    records = json.loads(out.read_text())
    modes = {"plain", "pdl", "barrier"} if torch.cuda.get_device_capability()[0] >= 9 else {"plain", "barrier"}
    assert {(r["grid"], r["mode"]) for r in records} == {(g, m) for g in (1, 132, 264) for m in modes}
    assert all(r["us_per_phase"] > 0 for r in records)
