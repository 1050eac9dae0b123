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
        slow = r["slowest_steps"]
        assert 1 <= len(slow) <= min(5, r["steps"]) and [s["step"] for s in slow] == sorted(s["step"] for s in slow)
        assert max(s["period_ms"] for s in slow) >= r["steady_period_ms"], r


def test_slowest_steps_are_the_longest_periods_in_step_order():
    from bench.step.throughput import slowest_steps
    trace = [dict(period=p / 1e3, forward_gpu=0.0, decode=i > 0, rows=2, tokens=2 if i else 9)
             for i, p in enumerate([9.0, 1.0, 1.1, 7.5, 1.0, 1.2])]
    slow = slowest_steps(trace, 3)
    assert [(s["step"], s["period_ms"], s["decode"], s["tokens"]) for s in slow] == \
        [(0, 9.0, False, 9), (3, 7.5, True, 2), (5, 1.2, True, 2)]
    assert slowest_steps([], 3) == []


def test_the_timed_generate_runs_over_a_frozen_heap_and_unfreezes_it():
    """A collection inside the timed generate walks only what the load made (as in the server's engine process), and
    the heap is unfrozen after it: a frozen engine would never be collected, nor its memory given back."""
    import gc
    from bench.step.throughput import time_generate
    from engine.llm_engine import LLMEngine
    eng = LLMEngine(model="dummy:tiny", device="cpu", dtype="float32", max_num_seqs=2)
    frozen, generate = [], eng.generate

    def generate_counting(prompts, params):
        frozen.append(gc.get_freeze_count())
        return generate(prompts, params)

    eng.generate = generate_counting
    try:
        out = time_generate(eng, [[5, 6, 7, 8], [9, 10, 11]], [[12, 13, 14]], new_tokens=3, warmup_tokens=2)
    finally:
        eng.close()
    assert out["generated_tokens"] == 6
    assert frozen[0] == 0 < frozen[1], frozen          # the warm-up on the live heap, the timed generate frozen
    assert gc.get_freeze_count() == 0
