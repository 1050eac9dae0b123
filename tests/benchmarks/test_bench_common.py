"""bench/common.py and the bench package: which tree's engine a bench imports, and the commit its records name."""
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROBE = "import bench.common, engine; print(engine.__file__); print(bench.common.__file__)"


def _imports(env_extra: dict) -> list[str]:
    """The files of `engine` and `bench.common` that code run from this repository imports (its cwd first on
    sys.path, as under `python -m`)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | env_extra
    run = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    return run.stdout.split()


def test_pythonpath_picks_the_engine_a_bench_runs(tmp_path):
    """`PYTHONPATH=<another tree> python -m bench.step.profile_step` measures that tree's engine with this tree's
    bench (how profile_step compares two trees): bench/__init__.py moves this repository after PYTHONPATH's
    entries. Without PYTHONPATH, or with one holding no engine (dependencies only), the repository's own."""
    other = tmp_path / "other"
    for package in ("engine", "bench"):                  # the other tree's bench must not be the one run
        (other / package).mkdir(parents=True)
        (other / package / "__init__.py").write_text("")
        (other / package / "common.py").write_text("")
    (tmp_path / "deps").mkdir()
    ours = [str(REPO / "engine" / "__init__.py"), str(REPO / "bench" / "common.py")]
    assert _imports({"PYTHONPATH": str(other)}) == [str(other / "engine" / "__init__.py"), ours[1]]
    assert _imports({"PYTHONPATH": f"{tmp_path / 'deps'}{os.pathsep}{other}"})[0] == str(other / "engine" /
                                                                                          "__init__.py")
    assert _imports({}) == ours
    assert _imports({"PYTHONPATH": str(tmp_path / "deps")}) == ours
    assert _imports({"PYTHONPATH": str(REPO)}) == ours


def test_a_bench_module_runs_with_another_trees_engine(tmp_path):
    """The same through `python -m bench.step.commit_time` itself (sys.path[0]: the cwd's full path, not '')."""
    other = tmp_path / "other" / "engine"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text(f"import sys; print('other engine', file=sys.stderr)\n"
                                       f"__path__.append({str(REPO / 'engine')!r})   # its modules: this one's\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(other.parent)}
    run = subprocess.run([sys.executable, "-m", "bench.step.commit_time", "--help"], cwd=REPO, env=env,
                         capture_output=True, text=True, check=True)
    assert "other engine" in run.stderr and "--out" in run.stdout, run.stdout + run.stderr


def test_records_name_the_commit(monkeypatch):
    from specdec.revision import git_commit
    monkeypatch.setenv("SPECDEC_GIT_COMMIT", "abc1234")
    assert git_commit() == "abc1234"
    monkeypatch.delenv("SPECDEC_GIT_COMMIT")
    assert re.fullmatch(r"[0-9a-f]{4,40}(-dirty)?|unknown", git_commit())


def test_engine_kwargs_take_model_and_device_only_where_given():
    from argparse import Namespace
    from bench.common import engine_kwargs
    assert engine_kwargs(Namespace(model=None, device="auto"), dtype="float32") == {"dtype": "float32"}
    assert engine_kwargs(Namespace(model="dummy:tiny", device="cpu"), max_num_seqs=2) == dict(
        max_num_seqs=2, model="dummy:tiny", device="cpu")
    assert engine_kwargs(Namespace(device="cpu")) == {"device": "cpu"}      # a bench without --model


def test_dtype_name_reads_the_engine_or_falls_back():
    from types import SimpleNamespace
    import torch
    from bench.common import dtype_name
    assert dtype_name(SimpleNamespace(runner=SimpleNamespace(dtype=torch.bfloat16))) == "bfloat16"
    assert dtype_name(SimpleNamespace(runner=SimpleNamespace()), "float16") == "float16"


def test_dummy_stream_prompts_share_no_page():
    """Dummy weights have no chat template: each stream's prompt must still be its own from the first page, or the
    prefix cache maps every stream onto the same KV and a bench at a long context times cached reads."""
    from bench.common import stream_prompt
    from engine.llm_engine import LLMEngine
    eng = LLMEngine(model="dummy:tiny", device="cpu", dtype="float32", max_num_seqs=2)
    try:
        block = eng.config.block_size
        prompts = [stream_prompt(eng, i, 3 * block) for i in range(64)]
    finally:
        eng.close()
    assert all(len(p) >= 3 * block for p in prompts)
    assert len({tuple(p[:block]) for p in prompts}) == len(prompts)
