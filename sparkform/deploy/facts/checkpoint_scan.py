"""The deploy's no-op check of the checkpoint folders: each folder (name@commit) under a models
folder, read against its manifest by size and mtime. It trusts both and hashes nothing.

    python3 -c SOURCE MODELS_DIR MARKER MANIFEST

The Snapshot fact (snapshot.py beside it) sends this file's text on the command line, so it runs
on a host before any deploy has put a file there: standard library only, nothing of sparkform
imported, the folder's own names (sparkform.host.folders) given as arguments. It lies here, not
in sparkform.host, whose every module the deploy installs on a host. One line per folder:
"folder|mtime|marker|verdict", the verdict "ok", "-" (no manifest that reads) or the files whose
size or mtime no longer match the manifest, comma-separated.
"""

import glob
import json
import os
import sys
from collections.abc import Iterator
from typing import Any


def same(folder: str, entry: dict[str, Any]) -> bool:
    """Whether the file a manifest entry names still has the size and mtime it recorded."""
    try:
        st = os.stat(os.path.join(folder, entry["path"]))
    except OSError:
        return False
    return bool(st.st_size == entry["size"] and abs(st.st_mtime - entry["mtime"]) < 1e-3)


def folder_line(folder: str, marker_name: str, manifest_name: str) -> str:
    try:
        with open(os.path.join(folder, marker_name)) as handle:
            marker = handle.read().strip()
    except OSError:
        marker = ""
    try:
        with open(os.path.join(folder, manifest_name)) as handle:
            files = json.load(handle)["files"]
        verdict = ",".join(e["path"] for e in files if not same(folder, e)) or "ok"
    except (OSError, ValueError, KeyError):
        verdict = "-"
    return "|".join((folder, str(os.stat(folder).st_mtime), marker, verdict))


def scan(models_dir: str, marker_name: str, manifest_name: str) -> Iterator[str]:
    """The line of each checkpoint folder under `models_dir`, one at a time."""
    for folder in glob.glob(os.path.join(models_dir, "*@*")):
        yield folder_line(folder, marker_name, manifest_name)


if __name__ == "__main__":
    for line in scan(*sys.argv[1:4]):
        print(line)
