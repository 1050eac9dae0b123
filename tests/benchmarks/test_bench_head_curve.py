"""bench/spec/head_curve.py's run specs, directories and the train_head commands it runs (CPU, no training)."""
import json

import pytest

from bench.spec.head_curve import COLUMNS, command, parse_args, rows, run_dir


def test_runs_parse_into_directories_and_commands(tmp_path):
    args = parse_args(["--data-dir", "D", "--runs", "6000:3", "0:5", "0:3:4", "--work", str(tmp_path)])
    assert args.runs == [(6000, 3, 1), (0, 5, 1), (0, 3, 4)]
    assert [run_dir(args, *r).name for r in args.runs] == ["n6000_d3", "nall_d5", "nall_d3_b4"]
    cmd = command(args, 0, 3, 4, "train")
    assert cmd[1:3] == ["-m", "specdec.train_head"] and cmd[cmd.index("--bucket") + 1] == "4"
    assert cmd[cmd.index("--data-dir") + 1] == "D" and cmd[cmd.index("--max-sequences") + 1] == "0"


@pytest.mark.parametrize("spec", ["3", "a:3", "10:0", "10:3:0", "10:3:2:1", "10:9"])
def test_bad_run_specs_are_refused(spec):
    with pytest.raises(SystemExit, match="--runs"):
        parse_args(["--data-dir", "D", "--runs", spec])


def test_rows_read_exported_runs_and_mark_the_missing(tmp_path):
    args = parse_args(["--data-dir", "D", "--runs", "100:3", "0:3", "--work", str(tmp_path)])
    done = run_dir(args, 100, 3, 1)
    done.mkdir(parents=True)
    acc = {name: {str(k): 1.0 + k / 2 for k in (1, 3, 5)} for name in ("all", "chat")}
    (done / "acceptance.json").write_text(json.dumps(acc | {"summary": {"sequences": 100, "step": 7, "train_s": 3.0,
                                                                        "tokens": 900}}))
    first, second = rows(args)
    assert first["sequences"] == 100 and first["steps"] == 7 and first["chat_k3"] == 2.5
    assert set(COLUMNS) <= set(first) and second["error"] == "not exported"
