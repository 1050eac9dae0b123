"""Every bench script under bench/<group>/ (and bench/ab.py) answers `python -m bench.<group>.<script> --help`, on
the CPU: a moved or renamed import breaks here, not on the GPU machine. One child process runs them all as `-m`
does (runpy), so the test session's own modules and environment are left alone."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p for p in [REPO / "bench" / "ab.py", *(REPO / "bench").glob("*/*.py")]
                 if "ArgumentParser" in p.read_text() and '__name__ == "__main__"' in p.read_text())
MODULES = [".".join(p.relative_to(REPO).with_suffix("").parts) for p in SCRIPTS]

CHILD = r"""
import contextlib, io, json, runpy, sys, warnings
warnings.simplefilter("ignore")          # runpy's "found in sys.modules" when one bench imported another first
answers = {}
for name in sys.argv[1:]:
    out = io.StringIO()
    sys.argv = [name, "--help"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        answers[name] = [None, out.getvalue()[:2000]]
    except SystemExit as e:
        answers[name] = [e.code, out.getvalue()[:2000]]
    except BaseException as e:            # noqa: BLE001 - reported per script
        answers[name] = ["error", f"{type(e).__name__}: {e}\n{out.getvalue()[:2000]}"]
print("ANSWERS " + json.dumps(answers))
"""


@pytest.fixture(scope="module")
def answers():
    r = subprocess.run([sys.executable, "-c", CHILD, *MODULES], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    line = next((x for x in r.stdout.splitlines() if x.startswith("ANSWERS ")), None)
    assert line, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(line[len("ANSWERS "):])


def test_the_scripts_are_found():
    assert len(MODULES) >= 30 and "bench.step.throughput" in MODULES and "bench.ab" in MODULES


@pytest.mark.parametrize("module", MODULES)
def test_help(answers, module):
    code, text = answers[module]
    assert code in (0, None) and "usage:" in text, text
    assert code == 0, f"{module} ran instead of printing its help"
