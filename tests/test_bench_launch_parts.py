"""bench/launch_parts.py: the host launch's parts, timed around the runner's own calls."""
import json
import time
from types import SimpleNamespace as NS

import pytest

from bench import launch_parts
from bench.launch_parts import PARTS, LaunchProbe
from engine.runner.slots import DecodeSlot


def test_a_part_inside_another_counts_for_the_outer_one_and_the_patches_go_on_exit():
    """The forward's own upload (nested) stays the forward's; the launch's upload is its own; rest = the launch
    less its parts; outside a launch nothing is timed; after exit the runner and DecodeSlot are as before."""
    upload = DecodeSlot.upload
    slot = NS()

    def forward(*_):
        DecodeSlot.upload(slot)           # nested: charged to the forward
        time.sleep(0.002)

    runner = NS(graphs=None, program=NS(step=forward))

    def launch():
        DecodeSlot.upload(slot)
        runner.program.step()
        time.sleep(0.001)

    runner.launch = launch
    calls = []
    DecodeSlot.upload = lambda self, padded=0: calls.append(self) or time.sleep(0.003)
    try:
        with LaunchProbe(runner) as probe:
            runner.launch()
            DecodeSlot.upload(slot)       # not inside a launch: untimed
        assert runner.launch is launch and "upload" in vars(DecodeSlot) and len(calls) == 3
    finally:
        DecodeSlot.upload = upload
    (one,) = probe.launches
    assert one["upload"] == pytest.approx(0.003, abs=0.002) and one["forward"] == pytest.approx(0.005, abs=0.002)
    assert one["rest"] == pytest.approx(0.001, abs=0.002) and one["download"] == one["events"] == 0.0
    assert sum(one[p] for p in PARTS) == pytest.approx(one["total"])


def test_a_cpu_run_charges_the_eager_forward_and_writes_every_part(tmp_path):
    out = tmp_path / "l.json"
    launch_parts.main(["--device", "cpu", "--dtype", "float32", "--streams", "1", "--steps", "3",
                       "--warmup-steps", "1", "--out", str(out)])
    (rec,) = json.loads(out.read_text())
    parts = rec["launch_us"]
    assert rec["launches"] == 3 and set(parts) == {"total", *PARTS}
    assert parts["forward"]["median"] > 0.5 * parts["total"]["median"]      # the CPU's launch is its forward
    assert parts["upload"]["max"] == 0.0                                     # the CPU uploads nothing
    assert rec["step_us"]["median"] >= parts["total"]["median"]
    assert "| 1 | forward |" in out.with_suffix(".md").read_text()


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="positive"):
        launch_parts.parse_args(["--steps", "0"])
