"""bench/guided/guided.py's speed part (bench/guided/guided_speed.py): guided against free rounds of a closed loop, for
real on the CPU (and its kernel profile on a GPU)."""
import json

import pytest
import torch

from bench.guided import guided


def _speed(tmp_path, *extra):
    out = tmp_path / "g.json"
    device = ["--device", "cpu", "--dtype", "float32"] if not torch.cuda.is_available() else []
    guided.main(["--only", "speed", *device, "--streams", "1", "--steps", "4", "--warm-steps", "2", "--rounds", "1",
                 "--max-tokens", "24", "--data", "tests/data", "--out", str(out), *extra])
    return {r["mode"]: r for r in json.loads(out.read_text())}, out.with_suffix(".md").read_text()


def test_a_guided_round_and_its_free_mirror_give_the_ratio_and_the_host_phases(tmp_path):
    records, text = _speed(tmp_path)
    g, f = records["guided"], records["free"]
    assert "error" not in g and "error" not in f
    assert g["guided_over_free"] == pytest.approx(g["period_ms"] / f["period_ms"])
    assert g["guided_steps"] > 0 and f["guided_steps"] == 0       # only the guided round filled masks
    for r in (g, f):
        assert r["steps"] >= 4 and r["tok_s"] > 0
        assert 0 < r["plan_ms"] + r["launch_ms"] + r["commit_ms"] <= r["period_ms"]
    assert "| 1 | guided |" in text and "launch_ms" in text


@pytest.mark.gpu
def test_profile_gives_each_mode_its_kernels_critical_path(tmp_path):
    records, text = _speed(tmp_path, "--profile")
    for r in records.values():
        assert 0 < r["path_ms"] <= r["profile"]["period_ms"] * 1.5
        assert r["profile"]["kinds"]["matmul"]["per_step"] > 0
    assert "path_ms" in text
