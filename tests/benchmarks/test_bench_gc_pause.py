"""bench.serving.gc_pause on the CPU: the heap it freezes, and its process's collector left as it found it."""
import gc
import json


def test_gc_pause_freezes_the_start_up_heap_then_unfreezes(tmp_path):
    from bench.serving import gc_pause
    out = tmp_path / "gc.json"
    gc_pause.main(["--model", "dummy:tiny", "--device", "cpu", "--dtype", "float32", "--streams", "2",
                   "--new-tokens", "4", "--collects", "2", "--out", str(out)])
    tracked, frozen = json.loads(out.read_text())
    assert (tracked["phase"], frozen["phase"]) == ("tracked", "frozen")
    assert tracked["frozen_objects"] == 0 and tracked["tracked_objects"] > 10_000
    assert frozen["frozen_objects"] > 10_000 and frozen["tracked_objects"] < frozen["frozen_objects"] / 10
    assert min(tracked["loop_s"], frozen["loop_s"]) > 0 and gc.get_freeze_count() == 0
    assert "| full_collect_ms_median |" in out.with_suffix(".md").read_text()
