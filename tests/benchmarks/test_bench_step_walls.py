"""bench/step/step_walls.py: each step's wall and the phases of a timed generate, through calls every tree has."""
import json

import pytest

from bench.step import step_walls


def test_each_round_times_the_generates_phases_and_names_its_slowest_steps(tmp_path):
    out = tmp_path / "w.json"
    step_walls.main(["--device", "cpu", "--dtype", "float32", "--streams", "2", "--new-tokens", "4", "--rounds", "2",
                     "--slowest", "3", "--profile", "10", "--out", str(out)])
    (r,) = json.loads(out.read_text())
    assert r["bench"] == "step_walls" and r["streams"] == 2 and len(r["rounds"]) == 2
    for rnd in r["rounds"]:
        assert rnd["tokens"] == 2 * 4 and rnd["steps"] >= 4
        assert rnd["in_steps_ms"] <= rnd["loop_ms"] <= rnd["wall_ms"]
        assert rnd["add_ms"] + rnd["loop_ms"] + rnd["take_ms"] + rnd["sync_ms"] <= rnd["wall_ms"] + 1e-6
        steps = [s["step"] for s in rnd["slowest"]]
        assert len(steps) == 3 and steps == sorted(steps) and max(steps) < rnd["steps"]
        assert min(s["ms"] for s in rnd["slowest"]) >= rnd["median_step_ms"]
    assert any("step" in line for line in r["profile"])


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="positive"):
        step_walls.parse_args(["--rounds", "0"])
    with pytest.raises(ValueError, match=">= 0"):
        step_walls.parse_args(["--slowest", "-1"])
