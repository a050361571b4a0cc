"""A copy of this checkout as a clone of it would hold it: the files git tracks, and the untracked
files git does not ignore (a new file counts before its commit); links stay links. A copy of the
folder itself would carry what a clone lacks (an ignored file, a build folder) and so hide a file
that .gitignore keeps out of every commit."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def copy_checkout(target: Path) -> Path:
    """`target` holding the checkout's files as a clone of it would; returns `target`."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout
    for name in filter(None, listed.split(b"\0")):
        source = REPO / os.fsdecode(name)
        if not source.is_symlink() and not source.exists():
            continue  # removed in the work tree, its removal not committed yet
        copy = target / os.fsdecode(name)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, copy, follow_symlinks=False)
    return target
