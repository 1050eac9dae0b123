"""bench/peers/stage_vllm.py and install_parts.py on small fake wheels: split into parts, collect them in any
order through the generated setup.sh, join (sha256), install with pip --target, skip what the interpreter
already has."""
import base64
import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from bench.peers import install_parts as ip
from bench.peers import stage_vllm as sv

KiB = 1024


def make_wheel(d: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal valid pure-Python wheel, stored uncompressed (its size is its payload's)."""
    dist = f"{name}-{version}.dist-info"
    files = dict(files)
    files[f"{dist}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    files[f"{dist}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    files[f"{dist}/RECORD"] = ("\n".join(record + [f"{dist}/RECORD,,"]) + "\n").encode()
    path = d / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name_, data in files.items():
            z.writestr(name_, data)
    return path


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def staged(tmp_path):
    src = tmp_path / "wheels"
    src.mkdir()
    big = os.urandom(300 * KiB)
    have = importlib.metadata.version("pytest")           # installed here: collect must skip it
    wheels = [make_wheel(src, "fakebig", "1.0", {"fakebig/__init__.py": b"", "fakebig/data.bin": big}),
              make_wheel(src, "fakesmall", "2.0", {"fakesmall/__init__.py": b"X = 2\n"}),
              make_wheel(src, "pytest", have, {"pytest_shadow_marker.py": b""})]
    schema = tmp_path / "JME_1.json"
    schema.write_text(json.dumps({"schema": {"type": "object"}}))
    tar = sv.schema_tar(str(tmp_path / "JME_*.json"), tmp_path / "jme.tar")
    files = wheels + [tar]
    kinds = {w.name: "wheel" for w in wheels} | {tar.name: "data"}
    n = sv.stage(files, kinds, tmp_path / "parts", 200 * KiB)
    return tmp_path, files, n, big


def run_setup(part: Path, root: Path) -> str:
    args = ["--stage-dir", root / "stage", "--site", root / "site", "--data", root / "data",
            "--env-file", root / "env.sh", "--keep-stage", "--no-smoke"]
    env = dict(os.environ, PYTHON=sys.executable)
    r = subprocess.run(["bash", str(part / "setup.sh"), *map(str, args)], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_split_collect_join_install(staged):
    root, files, n, big = staged
    parts = sorted((root / "parts").iterdir())
    assert n == len(parts) >= 3                               # the 300 KiB wheel alone needs 3 chunks
    for part in parts:
        assert sum(f.stat().st_size for f in part.iterdir()) <= 200 * KiB
    manifest = json.loads((parts[0] / "manifest.json").read_text())
    chunks = next(f["pieces"] for f in manifest["files"] if f["name"].startswith("fakebig"))
    assert len(chunks) == 3 and len({k for _, k in chunks}) == 3
    for part in reversed(parts[1:]):                           # any order; no install before the last
        assert "make the next call" in run_setup(part, root)
        assert not (root / "site").exists()
    out = run_setup(parts[0], root)
    assert "sha256 checked" in out and "skip pytest-" in out
    for f in files:
        assert sha(root / "stage" / "files" / f.name) == sha(f)
    assert (root / "site" / "fakebig" / "data.bin").read_bytes() == big
    assert (root / "site" / "fakesmall" / "__init__.py").read_text() == "X = 2\n"
    assert not (root / "site" / "pytest_shadow_marker.py").exists()
    assert json.loads((root / "data" / "maskbench" / "JME_1.json").read_text())["schema"] == {"type": "object"}
    assert f"SPECDEC_VLLM_SITE={root / 'site'}" in (root / "env.sh").read_text()


def test_join_rejects_a_corrupt_piece(staged):
    root, files, n, _ = staged
    stage = root / "stage"
    manifest = None
    for part in sorted((root / "parts").iterdir()):
        manifest = ip.collect(part, stage)
    name = next(f["pieces"][1][0] for f in manifest["files"] if len(f["pieces"]) > 1)
    data = bytearray((stage / name).read_bytes())
    data[100] ^= 0xFF
    (stage / name).write_bytes(bytes(data))
    assert ip.missing_parts(manifest, stage) == []
    with pytest.raises(SystemExit, match="sha256 mismatch"):
        ip.join(manifest, stage)


def test_slim_wheel_drops_members_and_record_lines(tmp_path):
    keep = {"vllm/__init__.py": b"__version__ = '0.0.1'\n"}
    dropped = {name: b"x" * 10 for name in sv.DROP}
    whl = make_wheel(tmp_path, "vllm", "0.0.1", keep | dropped)
    slim = sv.slim_wheel(whl, tmp_path / "slim")
    with zipfile.ZipFile(slim) as z:
        names = set(z.namelist())
        record = z.read("vllm-0.0.1.dist-info/RECORD").decode()
    assert "vllm/__init__.py" in names and not names & set(sv.DROP)
    assert not any(line.split(",")[0] in sv.DROP for line in record.splitlines())
    assert sv.slim_wheel(whl, tmp_path / "slim").stat().st_mtime_ns == slim.stat().st_mtime_ns   # reused
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                    str(tmp_path / "site"), str(slim)], check=True)
    assert (tmp_path / "site" / "vllm" / "__init__.py").exists()


def test_pack_respects_capacity():
    items = [dict(name=str(i), size=s) for i, s in enumerate([90, 60, 50, 40, 30, 10, 10])]
    parts = sv.pack(items, 100)
    assert all(sum(p["size"] for p in part) <= 100 for part in parts)
    assert sorted(p["name"] for part in parts for p in part) == sorted(p["name"] for p in items)
    assert len(parts) == 3


def test_schema_tar_is_deterministic(tmp_path):
    (tmp_path / "JME_2.json").write_text("{}")
    a = sv.schema_tar(str(tmp_path / "JME_*.json"), tmp_path / "a.tar")
    b = sv.schema_tar(str(tmp_path / "JME_*.json"), tmp_path / "b.tar")
    assert sha(a) == sha(b)
    with tarfile.open(a) as t:
        assert t.getnames() == ["maskbench/JME_2.json"]


def test_wheel_key():
    assert ip.wheel_key("annotated-types==0.8.0") == ip.wheel_key("annotated_types-0.8.0-py3-none-any.whl")
    assert ip.wheel_key("/w/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl") == ("vllm", "0.26.0")
