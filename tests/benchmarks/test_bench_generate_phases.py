"""bench.step.generate_phases on the CPU: each round's phases add up to its wall, and a variant's override reaches
its engine."""
import json

import pytest


def test_generate_phases_add_up_to_the_wall(tmp_path):
    from bench.step import generate_phases
    out = tmp_path / "p.json"
    generate_phases.main(["--model", "dummy:tiny", "--device", "cpu", "--dtype", "float32", "--streams", "2",
                          "--new-tokens", "4", "--rounds", "2", "--profile", "--top", "5",
                          "--variants", "d1:depth=1", "d2:depth=2", "--out", str(out)])
    records = json.loads(out.read_text())
    assert [(r["mode"], r["round"]) for r in records] == [("d1", 0), ("d1", 1), ("d2", 0), ("d2", 1)]
    for r in records:
        assert r["generated_tokens"] == 8 and r["steps"] >= 4 and r["in_steps_ms"] > 0, r
        parts = r["add_ms"] + r["loop_ms"] + r["take_ms"] + r["sync_ms"]
        assert parts == pytest.approx(r["wall_ms"], rel=1e-3), r
        assert r["loop_ms"] == pytest.approx(r["in_steps_ms"] + r["loop_outside_ms"]), r
        assert r["overrides"] == {"depth": int(r["mode"][1])}, r
    assert all("profile" in r for r in (records[1], records[3])) and "profile" not in records[0]
    assert any("step" in line for line in records[1]["profile"])


def test_gc_clock_counts_a_collection():
    import gc
    from bench.common import GcClock
    with GcClock() as clock:
        gc.collect()
    assert clock.count == {0: 0, 1: 0, 2: 1} and clock.ms > 0 and clock.pauses[0][0] == 2
    assert clock not in gc.callbacks
