"""The repository's markdown names files that exist: every relative link, and every bench/results/ path its text
names (globs `*` and brace sets `{a,b}` as the text writes them). A result moved or renamed fails here, not in a
reader's browser. A line marked "(pending)" may name a study that is not committed yet.

The README stays a front page: at most README_LINES lines, and every repository path it names (linked or not)
exists; so does every path the architecture page names at each hop of a request."""
import glob
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)|^\[[^\]]+\]:\s*(\S+)", re.M)
RESULT = re.compile(r"bench/results/[\w.\-/*{},]*[\w/*}]")
PATH = re.compile(r"(?<![\w/.])(?:engine|specdec|hostfunc|bench|docs|tests)/[\w.\-/]*[\w/]")
PENDING = "(pending)"
README_LINES = 150


def _markdown() -> list[Path]:
    files = subprocess.run(["git", "ls-files", "*.md"], cwd=REPO, capture_output=True, text=True).stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    return [REPO / f for f in files]


def _expand(pattern: str) -> list[str]:
    """{a,b} sets, each into its own pattern."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [p for alt in m.group(1).split(",") for p in _expand(pattern[:m.start()] + alt + pattern[m.end():])]


def _exists(base: Path, target: str) -> bool:
    return all(glob.glob(str(base / p)) for p in _expand(target))


def test_relative_links_resolve():
    broken = []
    for md in _markdown():
        for m in LINK.finditer(md.read_text(encoding="utf-8")):
            target = (m.group(1) or m.group(2)).split("#")[0]
            if target and not re.match(r"[a-z]+:", target) and not _exists(md.parent, target):
                broken.append(f"{md.relative_to(REPO)}: {target}")
    assert not broken, broken


def test_result_paths_named_in_the_docs_exist():
    """README, docs/ and bench's own READMEs: each bench/results/ path they name (from the repository root)."""
    broken = []
    for md in _markdown():
        rel = md.relative_to(REPO).as_posix()
        if rel.startswith("bench/results/"):
            continue                              # result READMEs quote commands and older paths as run
        for line in md.read_text(encoding="utf-8").splitlines():
            if PENDING in line:
                continue
            for m in RESULT.finditer(line):
                if not _exists(REPO, m.group(0).rstrip(".,")):
                    broken.append(f"{rel}: {m.group(0)}")
    assert not broken, broken


def test_readme_is_a_front_page():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_LINES, f"README.md has {len(lines)} lines; details belong in docs/"


@pytest.mark.parametrize("name", ["README.md", "docs/architecture.md"])
def test_paths_named_exist(name):
    """Linked or not: a file named on the front page or on a request's route exists (renamed code fails here)."""
    md = REPO / name
    broken = []
    for line in md.read_text(encoding="utf-8").splitlines():
        if PENDING in line:
            continue
        for m in LINK.finditer(line):
            target = (m.group(1) or m.group(2)).split("#")[0]
            if target and not re.match(r"[a-z]+:", target) and not _exists(md.parent, target):
                broken.append(target)
        broken += [m.group(0) for m in PATH.finditer(line) if not _exists(REPO, m.group(0))]
    assert not broken, broken


def test_the_checks_see_a_missing_file(tmp_path):
    assert [m.group(0) for m in PATH.finditer("engine/frontend.py, (docs/x.md) and bench/results/a/")] == [
        "engine/frontend.py", "docs/x.md", "bench/results/a/"]
    assert not _exists(REPO, "engine/frontend.py") and _exists(REPO, "engine/requests/frontend.py")
    assert _exists(REPO, "bench/results/eagle_head/head_v*_free.json")
    assert _exists(REPO, "bench/results/pdl/profile_pdl{0,1}.json")
    assert not _exists(REPO, "bench/results/pdl/profile_pdl{0,9}.json") and not _exists(tmp_path, "nothing.md")
