"""Stage vLLM for the GPU machine, which has no internet and takes at most 64 MiB per call, tree included.

    python -m bench.peers.stage_vllm                  # download (once), slim vLLM, split into .device/vllm/partN
    python -m bench.peers.stage_vllm --part-mib 40    # smaller parts (default: what fits beside the tree)

Then on the device, one call per part, back to back (a machine idle for 30 s is given back):
    carry [".device/vllm/part1"]  command: bash .device/vllm/part1/setup.sh
    ...
    carry [".device/vllm/partN"]  command: bash .device/vllm/partN/setup.sh && source /root/vllm-env.sh && ...
Each part holds its pieces, manifest.json, setup.sh and install_parts.py (the device's half: it copies the
pieces to /root/vllm-stage; the call that completes the set, parts in any order, joins them, checks sha256,
installs the wheels the image lacks with `pip install --no-index --no-deps --target /root/vllm-site`, unpacks
the schema tar into /root/vllm-data, writes /root/vllm-env.sh and imports vLLM once). A vLLM wheel is slimmed
(DROP below). docs/peers.md says why these versions and this set.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from bench.peers.install_parts import MiB, sha256, wheel_key

REPO = Path(__file__).resolve().parents[2]
PINS = REPO / "bench" / "peers" / "vllm_requirements.txt"   # vllm==X first, then what the image lacks
VLLM_SHA256 = "adb1e4c9b46d0dfdb094121ae5aad670a42412dd813ed4e5db069ed6a15006de"   # vllm 0.26.0's wheel
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (35, 34, 31, 28, 27, 26, 24, 17, 5)] + [
    "manylinux2014_x86_64", "manylinux1_x86_64"]
# Left out of vLLM's wheel (179 of its 290 MiB): FlashAttention 2 (an H100 runs FA3), the MoE kernels (imported
# under suppress(ImportError); Llama has no experts), the opt-in Rust frontend, DeepGEMM for other Pythons.
DROP = ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/_moe_C_stable_libtorch.abi3.so", "vllm/vllm-rs",
        *(f"vllm/third_party/deep_gemm/_C.cpython-3{v}-x86_64-linux-gnu.so" for v in (10, 11, 13, 14)))
# every JSON Mode Eval schema of a JSONSchemaBench copy named by $SPECDEC_DATA, else the few kept in tests/data
SCHEMAS = (f"{os.environ['SPECDEC_DATA']}/jsonschemabench/maskbench/JME_*.json" if os.environ.get("SPECDEC_DATA")
           else str(REPO / "tests" / "data" / "maskbench" / "JME_*.json"))
CALL_LIMIT, MARGIN = 64 << 20, 3 << 20


# ---- here: download, slim, split ----------------------------------------------------------------------
def pins(path: Path = PINS) -> list[str]:
    return [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def find_wheel(wheels: Path, pin: str) -> Path | None:
    hits = [w for w in wheels.glob("*.whl") if wheel_key(w.name) == wheel_key(pin)]
    return hits[0] if hits else None


def download(wheels: Path, wanted: list[str]) -> list[Path]:
    wheels.mkdir(parents=True, exist_ok=True)
    missing = [p for p in wanted if find_wheel(wheels, p) is None]
    if missing:
        print(f"downloading {len(missing)} wheels into {wheels}", flush=True)
        plats = [a for p in PLATFORMS for a in ("--platform", p)]
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", *plats, "-d", str(wheels), *missing],
                       check=True)
    found = [find_wheel(wheels, p) for p in wanted]
    absent = [p for p, w in zip(wanted, found) if w is None]
    if absent:
        raise SystemExit(f"no wheel for {', '.join(absent)} in {wheels}")
    return found


def slim_wheel(src: Path, dst_dir: Path, drop=DROP) -> Path:
    """src without the `drop` members (and their RECORD lines); reused while its sidecar matches."""
    dst, info = dst_dir / src.name, dst_dir / (src.name + ".slim.json")
    want = {"source_sha256": sha256(src), "dropped": sorted(drop)}
    if dst.exists() and info.exists() and json.loads(info.read_text()) == want:
        return dst
    dst_dir.mkdir(parents=True, exist_ok=True)
    print(f"slimming {src.name} (recompressing)", flush=True)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst.with_suffix(".tmp"), "w", zipfile.ZIP_DEFLATED) as zout:
        for item in zin.infolist():
            if item.filename in drop:
                continue
            data = zin.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(ln for ln in lines if ln.split(",", 1)[0] not in drop).encode()
            zout.writestr(item, data, compress_type=zipfile.ZIP_DEFLATED)
    os.replace(dst.with_suffix(".tmp"), dst)
    info.write_text(json.dumps(want))
    return dst


def schema_tar(pattern: str, dst: Path) -> Path | None:
    """The JSON Mode Eval schemas as one tar (the bench's guided work), members under maskbench/."""
    files = sorted(Path(f) for f in glob.glob(os.path.join(REPO, pattern)))   # absolute patterns too
    if not files:
        print(f"note: no schemas at {pattern}; the guided part will need --data on the device")
        return None
    dst.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(dst, "w") as tar:
        for f in files:
            info = tar.gettarinfo(str(f), arcname=f"maskbench/{f.name}")
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            with open(f, "rb") as fh:
                tar.addfile(info, fh)
    return dst


def pieces(files: list[Path], chunk: int) -> list[dict]:
    """One piece per file, or `name.KKKofNNN` chunks of at most `chunk` bytes for a bigger file."""
    out = []
    for f in files:
        size = f.stat().st_size
        n = max(1, -(-size // chunk))
        for k in range(n):
            name = f.name if n == 1 else f"{f.name}.{k + 1:03d}of{n:03d}"
            out.append(dict(name=name, file=f.name, src=f, offset=k * chunk, size=min(chunk, size - k * chunk)))
    return out


def pack(items: list[dict], capacity: int) -> list[list[dict]]:
    """First-fit decreasing: few parts, none over `capacity` bytes."""
    parts: list[list[dict]] = []
    for p in sorted(items, key=lambda p: -p["size"]):
        for part in parts:
            if sum(q["size"] for q in part) + p["size"] <= capacity:
                part.append(p)
                break
        else:
            parts.append([p])
    return parts


def auto_part_bytes(root: Path) -> int:
    """What a call can carry beside the tree (tracked and untracked-not-ignored files), in whole MiB."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, check=True).stdout
    tree = sum((root / p).stat().st_size for p in out.decode().split("\0") if p and (root / p).is_file())
    room = CALL_LIMIT - tree - MARGIN
    if room < 8 * MiB:
        raise SystemExit(f"the tree leaves only {room / MiB:.1f} MiB per call: shrink it or pass --part-mib")
    return min(room, 58 * MiB) // MiB * MiB


SETUP = """#!/usr/bin/env bash
# generated by bench/peers/stage_vllm.py: collects part {k} of {n} on the GPU machine; the call that
# completes the set installs vLLM into /root/vllm-site (arguments: install_parts.py's options)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
env -u PYTHONPATH "${{PYTHON:-python3}}" "$here/install_parts.py" --part "$here" "$@"
"""


def write_parts(parts: list[list[dict]], items: list[dict], files: list[Path], kinds: dict, out: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    where = {p["name"]: k + 1 for k, part in enumerate(parts) for p in part}
    manifest = dict(parts=len(parts), files=[
        dict(name=f.name, size=f.stat().st_size, sha256=sha256(f), kind=kinds[f.name],
             pieces=[(p["name"], where[p["name"]]) for p in items if p["file"] == f.name]) for f in files])
    for k, part in enumerate(parts, 1):
        d = out / f"part{k}"
        d.mkdir(parents=True)
        for p in part:
            with open(p["src"], "rb") as src, open(d / p["name"], "wb") as dst:
                src.seek(p["offset"])
                dst.write(src.read(p["size"]))
        (d / "manifest.json").write_text(json.dumps(manifest, indent=1))
        shutil.copy(Path(__file__).with_name("install_parts.py"), d / "install_parts.py")
        (d / "setup.sh").write_text(SETUP.format(k=k, n=len(parts)))
        (d / "setup.sh").chmod(0o755)
        size = sum(f.stat().st_size for f in d.iterdir())
        print(f"{d}: {len(part)} pieces, {size / MiB:.1f} MiB", flush=True)


def stage(files: list[Path], kinds: dict, out: Path, part_bytes: int) -> int:
    """Split `files` into parts of at most part_bytes (manifest and script included) under out/partN."""
    chunk = part_bytes - 64 * 1024                   # room for manifest.json, install_parts.py, setup.sh
    items = pieces(files, chunk)
    parts = pack(items, chunk)
    write_parts(parts, items, files, kinds, out)
    total = sum(f.stat().st_size for f in files)
    print(f"staged {len(files)} files, {total / MiB:.1f} MiB, in {len(parts)} parts of at most "
          f"{part_bytes / MiB:.1f} MiB under {out}")
    return len(parts)


def stage_main(args) -> None:
    wheels = Path(args.wheels)
    wanted = pins()
    paths = download(wheels, wanted) if not args.no_download else sorted(wheels.glob("*.whl"))
    for i, w in enumerate(paths):
        if wheel_key(w.name) == wheel_key(wanted[0]) and not args.full_vllm:
            if sha256(w) != VLLM_SHA256:
                raise SystemExit(f"{w}: sha256 differs from the release's {VLLM_SHA256}")
            paths[i] = slim_wheel(w, Path(args.slim_dir))
    kinds = {p.name: "wheel" for p in paths}
    tar = schema_tar(args.schemas, Path(args.slim_dir) / "jme_schemas.tar") if args.schemas else None
    if tar:
        paths.append(tar)
        kinds[tar.name] = "data"
    part_bytes = int(args.part_mib * MiB) if args.part_mib else auto_part_bytes(REPO)
    stage(paths, kinds, Path(args.out), part_bytes)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--wheels", default=str(REPO / ".data/vllm/wheels"), help="downloaded wheels")
    p.add_argument("--slim-dir", default=str(REPO / ".data/vllm/slim"), help="the slimmed wheel and the tar")
    p.add_argument("--out", default=str(REPO / ".device/vllm"), help="where partN/ go")
    p.add_argument("--part-mib", type=float, default=None, help="part size (default: 64 MiB less the tree)")
    p.add_argument("--no-download", action="store_true", help="every *.whl under --wheels, as they are")
    p.add_argument("--full-vllm", action="store_true", help="keep vLLM's wheel whole (+179 MiB)")
    p.add_argument("--schemas", default=SCHEMAS, help="schema files for the tar ('' for none)")
    return p.parse_args(argv)


def main(argv=None):
    stage_main(parse_args(argv))


if __name__ == "__main__":
    main()
