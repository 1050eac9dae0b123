"""bench/ab.py's side-by-side summary, with each tree's bench replaced by canned records (the benches themselves
run in their own tests)."""
import json

import pytest

from bench import ab


def _run(tok_s, idle_ms, period_ms=1.0, streams=1):
    return dict(streams=streams, tok_s=tok_s, gpu_idle_ms=idle_ms, period_ms=period_ms, model="m", dtype="bf16",
                ms_per_step=period_ms)


@pytest.fixture
def canned(monkeypatch):
    """run_tree returns, per (tree, mode), the next canned list of records."""
    calls, canned = [], {}

    def fake(tree, mode, args, engine):
        calls.append((tree.name, mode) + ((tuple(engine),) if engine else ()))
        return [dict(r, ab_mode=mode) for r in canned[(tree.name, mode) + ((tuple(engine),) if engine else ())].pop(0)]

    monkeypatch.setattr(ab, "run_tree", fake)
    return calls, canned


def test_the_summary_gives_ratios_idle_shares_and_the_host_bound_side(tmp_path, canned):
    calls, runs = canned
    before, after = tmp_path / "before", tmp_path / "after"
    runs[("before", "plain")] = [[_run(100.0, 0.01), _run(1000.0, 0.30, streams=32)],
                                 [_run(120.0, 0.03), _run(1000.0, 0.20, streams=32)]]
    runs[("after", "plain")] = [[_run(110.0, 0.02), _run(900.0, 0.02, streams=32)],
                                [_run(130.0, 0.02), _run(1100.0, 0.04, streams=32)]]
    out = tmp_path / "ab.json"
    ab.main(["--before", str(before), "--after", str(after), "--modes", "plain", "--streams", "1", "32",
             "--rounds", "2", "--out", str(out)])
    assert calls == [("before", "plain"), ("after", "plain"), ("after", "plain"), ("before", "plain")]
    one, many = json.loads(out.read_text())
    assert one["after_over_before"] == pytest.approx(120.0 / 110.0)
    assert one["before_idle"] == pytest.approx(0.02) and one["host_bound"] is None
    assert many["after_over_before"] == pytest.approx(1.0)
    assert many["before_idle"] == pytest.approx(0.25) and many["after_idle"] == pytest.approx(0.03)
    assert many["host_bound"] == "before"
    assert "| host_bound |" in out.with_suffix(".md").read_text()


def test_a_bench_without_idle_times_leaves_the_idle_columns_empty(tmp_path, canned):
    _, runs = canned
    runs[("before", "spec")] = [[dict(streams=8, tok_s=50.0)]]
    runs[("after", "spec")] = [[dict(streams=8, tok_s=55.0)]]
    out = tmp_path / "ab.json"
    ab.main(["--before", str(tmp_path / "before"), "--after", str(tmp_path / "after"), "--modes", "spec",
             "--streams", "8", "--rounds", "1", "--out", str(out)])
    (row,) = json.loads(out.read_text())
    assert row["after_over_before"] == pytest.approx(1.1)
    assert row["before_idle"] is None and row["after_idle"] is None and row["host_bound"] is None
    assert row["before_forward_ms"] is None and row["after_forward_ms"] is None
    assert row["before_slowest_steps"] == [] and row["after_slowest_steps"] == []


def test_each_sides_slowest_steps_are_kept_a_run(tmp_path, canned):
    _, runs = canned
    slow = [dict(step=3, period_ms=12.0, decode=True)]
    runs[("before", "plain")] = [[dict(streams=1, tok_s=50.0)]]
    runs[("after", "plain")] = [[dict(streams=1, tok_s=40.0, slowest_steps=slow)]]
    out = tmp_path / "ab.json"
    ab.main(["--before", str(tmp_path / "before"), "--after", str(tmp_path / "after"), "--modes", "plain",
             "--streams", "1", "--rounds", "1", "--out", str(out)])
    (row,) = json.loads(out.read_text())
    assert row["before_slowest_steps"] == [] and row["after_slowest_steps"] == [slow]


def test_each_sides_median_forward_whatever_its_bench_calls_it(tmp_path, canned):
    """throughput and spec report forward_gpu_ms, guided forward_ms: either is the side's GPU time a step; sides
    that finished different numbers of requests ran different loads, and the row says so. throughput's time
    outside the engine's steps comes as each side's median."""
    _, runs = canned
    runs[("before", "guided")] = [[dict(streams=32, tok_s=300.0, forward_ms=0.95, requests_done=183)],
                                  [dict(streams=32, tok_s=310.0, forward_ms=0.94, requests_done=183)]]
    runs[("after", "guided")] = [[dict(streams=32, tok_s=280.0, forward_ms=0.99, requests_done=187)],
                                 [dict(streams=32, tok_s=290.0, forward_ms=0.98, requests_done=187)]]
    runs[("before", "plain")] = [[dict(streams=32, tok_s=4.0, forward_gpu_ms=0.74, outside_steps_ms=1.0, gc_ms=0.0)],
                                 [dict(streams=32, tok_s=4.0, outside_steps_ms=0.8, gc_ms=0.2)]]
    runs[("after", "plain")] = [[dict(streams=32, tok_s=4.0, forward_gpu_ms=0.73, outside_steps_ms=5.0)],
                                [dict(streams=32, tok_s=4.0, outside_steps_ms=6.0)]]
    out = tmp_path / "ab.json"
    ab.main(["--before", str(tmp_path / "before"), "--after", str(tmp_path / "after"), "--modes", "guided", "plain",
             "--streams", "32", "--rounds", "2", "--out", str(out)])
    guided, plain = json.loads(out.read_text())
    assert (guided["before_forward_ms"], guided["after_forward_ms"]) == (pytest.approx(0.945), pytest.approx(0.985))
    assert (plain["before_forward_ms"], plain["after_forward_ms"]) == (0.74, 0.73)     # runs without it are left out
    assert guided["requests_done"] == "183 / 187" and plain["requests_done"] is None     # the loads differ, or not
    assert (plain["before_outside_ms"], plain["after_outside_ms"]) == (pytest.approx(0.9), pytest.approx(5.5))
    assert (plain["before_gc_ms"], plain["after_gc_ms"]) == (pytest.approx(0.1), None)
    assert guided["before_outside_ms"] is None                 # only throughput times what lies outside its steps
    assert "| before_forward_ms | after_forward_ms | before_gc_ms | after_gc_ms |" in out.with_suffix(".md").read_text()


def test_one_tree_against_itself_with_a_setting_flipped(tmp_path, canned):
    """--after-engine: the same tree on both sides, the after side's bench run with the setting; the records and
    the table name it. The same tree with the same settings is refused."""
    calls, runs = canned
    tree, flip = tmp_path / "tree", ("native_launch=true",)
    runs[("tree", "plain")] = [[_run(100.0, 0.01)]]
    runs[("tree", "plain", flip)] = [[_run(125.0, 0.01)]]
    out = tmp_path / "ab.json"
    ab.main(["--before", str(tree), "--after", str(tree), "--after-engine", *flip, "--modes", "plain", "--streams",
             "1", "--rounds", "1", "--out", str(out)])
    assert calls == [("tree", "plain"), ("tree", "plain", flip)]
    (row,) = json.loads(out.read_text())
    assert row["after_over_before"] == pytest.approx(1.25) and row["after_engine"] == list(flip)
    assert "after settings native_launch=true" in out.with_suffix(".md").read_text()
    with pytest.raises(ValueError, match="same tree with the same settings"):
        ab.parse_args(["--before", str(tree), "--after", str(tree)])


def test_a_sides_settings_reach_its_bench_as_engine_fields(tmp_path):
    args = ab.parse_args(["--after-engine", "native_launch=true", "split_merge=false", "--streams", "1", "8"])
    cmd = ab.bench_command(tmp_path, "plain", args, args.after_engine, tmp_path / "t.json")
    assert cmd[cmd.index("--streams") + 1:cmd.index("--streams") + 3] == ["1", "8"]
    assert cmd[cmd.index("--engine") + 1:] == ["native_launch=true", "split_merge=false"]
    assert "--engine" not in ab.bench_command(tmp_path, "spec", args, args.before_engine, tmp_path / "t.json")
    assert "--model" not in cmd


def test_a_model_reaches_both_sides_benches(tmp_path):
    args = ab.parse_args(["--model", "dummy:llama-1b", "--before-engine", "kernels=reference", "--modes", "plain",
                          "spec"])
    for mode in args.modes:
        cmd = ab.bench_command(tmp_path, mode, args, [], tmp_path / "t.json")
        assert cmd[cmd.index("--model") + 1] == "dummy:llama-1b"


def test_a_misspelt_dummy_shape_fails_before_any_run():
    with pytest.raises(ValueError, match="unknown dummy shape 'llama1b'"):
        ab.parse_args(["--model", "dummy:llama1b", "--before-engine", "kernels=reference"])


def _tree(root, *scripts):
    for script in scripts:
        (root / "bench" / script).parent.mkdir(parents=True, exist_ok=True)
        (root / "bench" / script).write_text("")
    return root


@pytest.mark.parametrize("mode,grouped,flat", [("plain", "step/throughput.py", "throughput.py"),
                                               ("guided", "guided/guided.py", "guided.py"),
                                               ("spec", "spec/spec.py", "spec.py")])
def test_each_tree_runs_its_bench_in_its_own_layout(tmp_path, mode, grouped, flat):
    """A tree with bench/<group>/<script>.py runs it as a module; an older checkout with the flat bench/ layout
    (a --before tree) runs its bench/<script>.py as a file."""
    args = ab.parse_args(["--after-engine", "native_launch=true"])
    new = _tree(tmp_path / "new", "__init__.py", grouped, "common.py")
    old = _tree(tmp_path / "old", flat, "common.py")
    out = tmp_path / "t.json"
    assert ab.bench_command(new, mode, args, [], out)[1:3] == ["-m", "bench." + grouped[:-3].replace("/", ".")]
    cmd = ab.bench_command(old, mode, args, [], out)
    assert cmd[1] == str(old / "bench" / flat) and cmd[2] != "-m"
    assert ab.bench_command(new, mode, args, [], out)[3:] == cmd[2:]        # the same arguments either way


def test_guided_open_asks_only_a_tree_with_the_closing_for_its_open_rows(tmp_path):
    """guided-open passes --open-too to a tree whose guided bench knows it, and runs a tree from before the closing
    in its guided mode, with the same arguments otherwise."""
    args = ab.parse_args(["--after-engine", "native_launch=true", "--modes", "guided-open"])
    new = _tree(tmp_path / "new", "__init__.py", "guided/guided.py", "common.py")
    (new / "bench" / "guided" / "guided.py").write_text('p.add_argument("--open-too")')
    old = _tree(tmp_path / "old", "__init__.py", "guided/guided.py", "common.py")
    out = tmp_path / "t.json"
    with_open, without = (ab.bench_command(t, "guided-open", args, [], out) for t in (new, old))
    assert ab.OPEN_FLAG in with_open and ab.OPEN_FLAG not in without
    assert [a for a in with_open if a != ab.OPEN_FLAG] == without
