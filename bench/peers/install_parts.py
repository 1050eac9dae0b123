"""The GPU machine's half of bench/peers/stage_vllm.py, copied into every part it writes (stdlib only).

    bash .device/vllm/partK/setup.sh      # = env -u PYTHONPATH python3 install_parts.py --part .device/vllm/partK

Copies the part's pieces to --stage-dir. The call that completes the set (parts in any order) joins the pieces,
checks every file's sha256, installs the wheels the image does not hold at that version with `pip install
--no-index --no-deps --target --site`, unpacks data tars into --data, writes --env-file and imports vLLM once.
setup.sh unsets PYTHONPATH, so "the image holds it" means the image alone, not the engine's /root/site.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

MiB = 1 << 20


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MiB), b""):
            h.update(block)
    return h.hexdigest()


def wheel_key(filename: str) -> tuple[str, str]:
    """(normalized name, version) of a wheel file name or of a NAME==VERSION pin."""
    name, version = filename.split("==") if "==" in filename else Path(filename).name.split("-")[:2]
    return re.sub(r"[-_.]+", "_", name).lower(), version


# ---- collect, join, install --------------------------------------------------------------------
def collect(part: Path, stage_dir: Path) -> dict:
    manifest = json.loads((part / "manifest.json").read_text())
    stage_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(part / "manifest.json", stage_dir / "manifest.json")
    names = [name for f in manifest["files"] for name, _ in f["pieces"]]
    mine = [n for n in names if (part / n).exists()]
    for n in mine:
        shutil.copyfile(part / n, stage_dir / (n + ".tmp"))
        os.replace(stage_dir / (n + ".tmp"), stage_dir / n)
    print(f"{part.name}: copied {len(mine)} pieces to {stage_dir}", flush=True)
    return manifest


def missing_parts(manifest: dict, stage_dir: Path) -> list[int]:
    return sorted({k for f in manifest["files"] for name, k in f["pieces"] if not (stage_dir / name).exists()})


def join(manifest: dict, stage_dir: Path) -> list[tuple[Path, str]]:
    """Every file rebuilt from its pieces under stage_dir/files, its sha256 checked: [(path, kind)]."""
    out_dir = stage_dir / "files"
    out_dir.mkdir(exist_ok=True)
    out = []
    for f in manifest["files"]:
        path = out_dir / f["name"]
        with open(path, "wb") as dst:
            for name, _ in f["pieces"]:
                with open(stage_dir / name, "rb") as src:
                    shutil.copyfileobj(src, dst, MiB)
        if sha256(path) != f["sha256"]:
            raise SystemExit(f"{f['name']}: sha256 mismatch after joining {len(f['pieces'])} pieces")
        out.append((path, f["kind"]))
    print(f"joined {len(out)} files, sha256 checked", flush=True)
    return out


def image_has(wheel: Path) -> bool:
    """The image (PYTHONPATH unset by setup.sh) already holds this exact version."""
    name, version = wheel_key(wheel.name)
    try:
        return importlib.metadata.version(name) == version
    except importlib.metadata.PackageNotFoundError:
        return False


def install(files: list[tuple[Path, str]], site: Path, data: Path) -> list[Path]:
    wheels = [p for p, kind in files if kind == "wheel"]
    todo = [w for w in wheels if not image_has(w)]
    for w in sorted(set(wheels) - set(todo)):
        print(f"skip {w.name}: the image has this version")
    print(f"installing {len(todo)} wheels into {site}", flush=True)
    if todo:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, todo)], check=True)
    for p, kind in files:
        if kind == "data":
            data.mkdir(parents=True, exist_ok=True)
            with tarfile.open(p) as tar:
                tar.extractall(data, filter="data")
            print(f"unpacked {p.name} into {data}")
    return todo


ENV = """export SPECDEC_VLLM_SITE={site} SPECDEC_VLLM_DATA={data} VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1
# FlashInfer is not staged: vLLM's sampler would import it to ask whether it may use it
export VLLM_USE_FLASHINFER_SAMPLER=0
# vLLM's side only: its wheels first, not the engine's /root/site (other pydantic and tvm-ffi versions)
vllm_python() {{ PYTHONPATH={site} python3 "$@"; }}
"""
SMOKE = "import vllm, vllm.entrypoints.llm, vllm.entrypoints.openai.api_server; print('vllm', vllm.__version__)"


def smoke(site: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(site), VLLM_NO_USAGE_STATS="1")
    r = subprocess.run([sys.executable, "-c", SMOKE], env=env, capture_output=True, text=True)
    print(r.stdout.strip() or r.stderr[-3000:])
    if r.returncode:
        raise SystemExit("vLLM does not import from the staged site (above); see docs/peers.md")


def main(argv=None) -> None:
    args = parse_args(argv)
    part, stage_dir = Path(args.part), Path(args.stage_dir)
    manifest = collect(part, stage_dir)
    missing = missing_parts(manifest, stage_dir)
    if missing:
        print(f"staged {part.name}; still missing parts {missing}: make the next call within 30 s")
        return
    files = join(manifest, stage_dir)
    installed = install(files, Path(args.site), Path(args.data))
    Path(args.env_file).write_text(ENV.format(site=args.site, data=args.data))
    print(f"wrote {args.env_file}")
    if any(wheel_key(w.name)[0] == "vllm" for w in installed) and not args.no_smoke:
        smoke(Path(args.site))
    if not args.keep_stage:
        shutil.rmtree(stage_dir, ignore_errors=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", required=True, help="this part's directory")
    p.add_argument("--stage-dir", default="/root/vllm-stage")
    p.add_argument("--site", default="/root/vllm-site")
    p.add_argument("--data", default="/root/vllm-data")
    p.add_argument("--env-file", default="/root/vllm-env.sh")
    p.add_argument("--no-smoke", action="store_true", help="skip the vLLM import check")
    p.add_argument("--keep-stage", action="store_true", help="keep the pieces and joined files")
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
