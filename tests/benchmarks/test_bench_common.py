"""bench/common.py: which tree's engine a bench imports, and the commit its records name."""
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_pythonpath_picks_the_engine_a_bench_runs(tmp_path):
    """`PYTHONPATH=<another tree> python bench/x.py` measures that tree's engine (how profile_step compares two
    trees); without PYTHONPATH, the bench's own repository."""
    other = tmp_path / "other"
    (other / "engine").mkdir(parents=True)
    (other / "engine" / "__init__.py").write_text("")
    code = f"import sys; sys.path.insert(0, {str(REPO / 'bench')!r}); import common, engine; print(engine.__file__)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = lambda extra: subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env | extra,  # noqa: E731
                                       capture_output=True, text=True, check=True).stdout.strip()
    assert run({"PYTHONPATH": str(other)}) == str(other / "engine" / "__init__.py")
    assert run({}) == str(REPO / "engine" / "__init__.py")


def test_records_name_the_commit(monkeypatch):
    from specdec.revision import git_commit
    monkeypatch.setenv("SPECDEC_GIT_COMMIT", "abc1234")
    assert git_commit() == "abc1234"
    monkeypatch.delenv("SPECDEC_GIT_COMMIT")
    assert re.fullmatch(r"[0-9a-f]{4,40}(-dirty)?|unknown", git_commit())
