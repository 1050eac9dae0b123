"""bench/step/launch_parts.py: the host launch's parts, timed around the runner's own calls."""
import json
from types import SimpleNamespace as NS

import pytest

from bench.step import launch_parts
from bench.step.launch_parts import PARTS, LaunchProbe
from engine.runner.slots import DecodeSlot


def test_a_part_inside_another_counts_for_the_outer_one_and_the_patches_go_on_exit():
    """The forward's own upload (nested) stays the forward's; the launch's upload is its own; rest = the launch
    less its parts; outside a launch nothing is timed; after exit the runner and DecodeSlot are as before."""
    upload, slot, now = DecodeSlot.upload, NS(), [0.0]      # a clock that moves only where the fakes move it

    def forward(*_):
        DecodeSlot.upload(slot)           # nested: charged to the forward
        now[0] += 2.0

    runner = NS(graphs=None, program=NS(step=forward))

    def launch():
        DecodeSlot.upload(slot)
        runner.program.step()
        now[0] += 1.0

    def upload_now(self, padded=0):
        calls.append(self)
        now[0] += 3.0

    runner.launch, calls = launch, []
    DecodeSlot.upload = upload_now
    try:
        with LaunchProbe(runner, clock=lambda: now[0]) as probe:
            runner.launch()
            DecodeSlot.upload(slot)       # not inside a launch: untimed
        assert runner.launch is launch and DecodeSlot.upload is upload_now and len(calls) == 3
    finally:
        DecodeSlot.upload = upload
    (one,) = probe.launches
    assert (one["upload"], one["forward"], one["rest"], one["total"]) == (3.0, 5.0, 1.0, 9.0)
    assert one["download"] == one["events"] == one["native"] == 0.0


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
