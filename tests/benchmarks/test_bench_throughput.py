"""bench.step.throughput on the CPU: a record per case whose wall splits into the engine's step calls and the rest."""
import json

import pytest


def test_throughput_splits_its_wall_into_steps_and_the_rest(tmp_path):
    from bench.step import throughput
    out = tmp_path / "t.json"
    throughput.main(["--model", "dummy:tiny", "--device", "cpu", "--dtype", "float32", "--streams", "2",
                     "--new-tokens", "4", "--depth", "1", "2", "--out", str(out)])
    records = json.loads(out.read_text())
    assert [(r["mode"], r["streams"]) for r in records] == [("blocking", 2), ("pipelined", 2)]
    for r in records:
        assert r["generated_tokens"] == 8 and r["steps"] >= 4 and r["outside_steps_ms"] >= 0, r
        assert r["gc_ms"] >= 0 and r["gc_collections"] >= 0, r
        in_steps = r["period_ms"] * r["steps"]
        assert in_steps + r["outside_steps_ms"] == pytest.approx(1e3 * r["wall_s"], rel=1e-6), r
        # the steady medians: decode steps of both streams only (not the prefill), each at most the run's longest
        assert 1 <= r["steady_steps"] < r["steps"] and 0 < r["steady_period_ms"] <= 1e3 * r["wall_s"], r
