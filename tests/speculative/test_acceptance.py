"""specdec.acceptance on the CPU: a real study writes its files, its numbers are within their bounds, greedy
speculation reproduces the engine without it, guided runs decode under their schema, bad inputs are refused."""
import csv
import json

import pytest

from engine.cli import cmd_acceptance, parser
from helpers import CAT
from specdec.acceptance import Study, main, run_study

CPU = ["--device", "cpu", "--dtype", "float32"]


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("study") / "study"
    main(["--datasets", "JME", "chat", "--drafters", "ngram", "--k", "1", "2", "--guided", "off", "--prompts", "2",
          "--max-tokens", "16", "--batch", "4", *CPU, "--out", str(prefix)])
    return prefix, json.loads(prefix.with_name("study.json").read_text())


def test_study_writes_its_files(study):
    prefix, records = study
    md = prefix.with_name("study.md").read_text()
    assert "Acceptance length" in md and "by draft position" in md and "not a speed measurement" in md
    assert "python -m specdec.acceptance --datasets JME chat" in md
    with prefix.with_name("study.csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(records)
    # none, then K 1 and 2, each over both datasets
    assert [(r["method"], r["k"], r["dataset"]) for r in records] == \
        [(m, k, d) for m, k in (("none", 0), ("ngram", 1), ("ngram", 2)) for d in ("JME", "chat")]


def test_acceptance_within_bounds(study):
    spec = [r for r in study[1] if r["drafter"] != "none"]
    assert any(r["acceptance_length"] is not None for r in spec)
    for r in spec:
        assert r["acceptance_length"] is None or 1 <= r["acceptance_length"] <= r["k"] + 1
        accepted, proposed = r["accepted_by_position"], r["proposed_by_position"]
        assert len(proposed) <= r["k"] and all(0 <= rate <= 1 for rate in r["rate_by_position"])
        assert all(a <= p for a, p in zip(accepted, proposed))
        # position i + 1 is proposed (accepted) only where position i was
        assert all(b <= a for a, b in zip(proposed, proposed[1:]))
        assert all(b <= a for a, b in zip(accepted, accepted[1:]))
        assert r["speedup"] is None and r["device"] == "cpu"


def test_greedy_speculation_gives_the_tokens_of_none(study):
    spec = [r for r in study[1] if r["drafter"] != "none"]
    assert spec and all(r["same_tokens_as_none"] is True for r in spec)


def test_guided_runs_decode_under_their_schema(tmp_path):
    (tmp_path / "cat.json").write_text(json.dumps(CAT))
    (tmp_path / "wrapped.json").write_text(json.dumps({"schema": CAT, "tests": []}))       # MaskBench's format
    records = run_study(Study(datasets=[f"cats={tmp_path}"], ks=[2], guided=[False, True], prompts=2, batch=2,
                              max_tokens=40, device="cpu", dtype="float32", baseline=False), progress=False)
    by = {r["guided"]: r for r in records}
    assert set(by) == {False, True} and by[True]["prompts"] == 2
    assert by[True]["guided_steps"] > 0 and by[False]["guided_steps"] == 0
    assert by[True]["finished_frac"] == 1.0 and by[True]["json_frac"] == 1.0
    assert by[True]["valid_frac"] == 1.0 and by[False]["valid_frac"] is None, "guided outputs validate"
    assert by[True]["forced_per_step"] == 0.0, "the n-gram drafter forces nothing"


def test_passes_run_each_case_again_on_the_same_engine(tmp_path):
    """passes=2: each case twice on one engine, records in order with their pass; greedy tokens agree with the
    baseline's of the same pass."""
    (tmp_path / "cat.json").write_text(json.dumps(CAT))
    records = run_study(Study(datasets=[f"cats={tmp_path}"], ks=[2], guided=[True], prompts=2, batch=2,
                              max_tokens=24, device="cpu", dtype="float32", passes=2), progress=False)
    assert [(r["method"], r["pass"]) for r in records] == [("none", 1), ("none", 2), ("ngram", 1), ("ngram", 2)]
    assert all(r["same_tokens_as_none"] is True for r in records[2:])
    assert records[2]["new_tokens"] == records[3]["new_tokens"] > 0


def test_heads_compared_in_one_study(tmp_path):
    """Two head directories give two methods named after them, over one baseline; the same weights under two
    names give the same tokens and acceptance."""
    import shutil

    from specdec.acceptance.study import Method
    shipped = Method("eagle", 1).engine_kwargs(Study(datasets=["chat"])).get("spec_head")
    assert shipped is None, "no --head: the engine's own shipped head"
    from engine.speculative.eagle_paged import HEADS
    src = HEADS / "smollm2-135m"
    heads = [str(shutil.copytree(src, tmp_path / name)) for name in ("first", "second")]
    records = run_study(Study(datasets=["chat"], drafters=["eagle"], ks=[2], guided=[False], prompts=2, batch=2,
                              max_tokens=16, device="cpu", dtype="float32", heads=heads), progress=False)
    assert [r["method"] for r in records] == ["none", "eagle[first]", "eagle[second]"]
    a, b = records[1], records[2]
    assert a["head"] == heads[0] and b["head"] == heads[1]
    assert a["acceptance_length"] == b["acceptance_length"] and a["same_tokens_as_none"] and b["same_tokens_as_none"]
    twins = Study(datasets=["chat"], heads=[str(tmp_path / "x" / "head"), str(tmp_path / "y" / "head")])
    assert list(twins.head_labels().values()) == ["x/head", "y/head"], "same names: the parent tells them apart"


@pytest.mark.parametrize("change, message", [
    (dict(datasets=["FOO"]), "--datasets: unknown dataset 'FOO'; choose from JME, BFCL"),
    (dict(ks=[0]), "--k: 0 is not"),
    (dict(drafters=["medusa"]), "--drafters"),
    (dict(drafters=["draft_model"]), "--draft-model"),
    (dict(datasets=["mine=/nonexistent"]), "no file or directory"),
    (dict(batch=0), "--batch"),
    (dict(passes=0), "--passes: must be >= 1, got 0"),
    (dict(drafters=["eagle"], heads=["/nonexistent"]), "--head: '/nonexistent' is not a head directory"),
])
def test_bad_inputs_raise(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        run_study(Study(**(dict(datasets=["JME"]) | change)))


@pytest.mark.parametrize("argv, message", [(["--datasets", "FOO"], "choose from JME, BFCL"),
                                           (["--k", "0"], "argument --k: must be an integer >= 1")])
def test_command_line_refuses_bad_inputs(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv + CPU)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_specdec_acceptance_hands_every_argument_to_the_study():
    args = parser().parse_args(["acceptance", "--datasets", "JME", "--k", "1", "--help"])
    assert args.func is cmd_acceptance and args.study_args == ["--datasets", "JME", "--k", "1", "--help"]
