"""The decode kernels that are off by default or new compile for Hopper (sm_90) without a GPU:
bench/kernels/compile_check.py, in a subprocess (the test session builds kernels for the interpreter, which never
lowers them)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_kernels_compile_for_sm90_with_pdl_exactly_when_asked():
    triton = pytest.importorskip("triton")
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (tools / "ptxas").exists() or not (tools / "cuobjdump").exists():
        pytest.skip("this Triton has no bundled CUDA toolchain")
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-m", "bench.kernels.compile_check"], cwd=REPO, capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("0 failed"), r.stdout + r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith(("ok", "FAIL"))]
    assert len(lines) == 74 and all(", 0 B local," in line for line in lines), r.stdout   # no spills
    assert sum(" stream_gemm split " in line for line in lines) == 2, r.stdout     # the split-K launch
    assert sum(" topk " in line for line in lines) == 4, r.stdout       # a tree's candidates, with and without PDL
    assert sum(" decode_stack " in line for line in lines) == 3, r.stdout     # the persistent stack, one launch
    head = [line for line in lines if " head_mma " in line]
    assert len(head) == 4 and all(line.endswith("wgmma") for line in head), r.stdout   # Hopper's warpgroup MMA
