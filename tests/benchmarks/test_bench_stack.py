"""bench.step.stack on the CPU: one tiny run (the stack in the Triton interpreter, the layers on the torch backend)
writes its records, and every stack variant's output matches the layers' forward."""
import json

from bench.step import stack


def test_a_tiny_run_times_every_side_and_checks_each_against_the_layers(tmp_path):
    out = tmp_path / "stack.json"
    records = stack.main(["--device", "cpu", "--dtype", "float32", "--shapes", "tiny", "--rows", "1", "3",
                          "--contexts", "20", "--repeats", "1", "--variants", "a:", "b:num_warps=8,product=4096",
                          "--peak-gbps", "50", "--out", str(out)])
    assert [(r["rows"], r["side"]) for r in records] == [(1, "layers"), (1, "stack a"), (1, "stack b"),
                                                         (3, "layers"), (3, "stack a"), (3, "stack b")]
    assert all(r["max_err"] < 1e-5 and r["us"] > 0 and r["floor_us"] > 0 for r in records)
    assert json.loads(out.read_text()) == records
