"""The commit a result was measured at, for the records of benches and studies."""
from __future__ import annotations

import os
import subprocess

from specdec.datasets import REPO


def git_commit() -> str:
    """HEAD's short hash (+ "-dirty" with uncommitted changes to tracked files), or $SPECDEC_GIT_COMMIT: a copy
    of the tree on another machine (the GPU machine's) can carry a stale .git, so pass the commit there
    (`SPECDEC_GIT_COMMIT=$(git rev-parse --short HEAD)` where the run is planned)."""
    if os.environ.get("SPECDEC_GIT_COMMIT"):
        return os.environ["SPECDEC_GIT_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=REPO).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=REPO).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
