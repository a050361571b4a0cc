"""A checkpoint folder's own names, and which paths from a hub or a manifest lie inside one
(shared by sparkform-checkpoint and sparkform-scrub on the host, and by the deploy)."""

import re
from pathlib import PurePosixPath

COMPLETE_MARKER = ".sparkform-complete"  # written last; holds the commit the folder was proved against
MANIFEST = ".sparkform-manifest.json"  # (path, size, sha256, mtime) of every file, as proved
PARTIAL = ".partial"  # downloads in progress, below the folder; never loaded, never in the manifest
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# sparkform's own names in a checkpoint folder: no file from elsewhere may take one.
OWN_NAMES = (COMPLETE_MARKER, MANIFEST, PARTIAL)


def relative_file(path):
    """Whether `path` names a file inside the folder, as a plain relative path (no '..', '.',
    '/' first, empty part or control character) and not one of sparkform's own names: root
    reads, writes and deletes nothing else on a hub's or a manifest's word."""
    if not isinstance(path, str) or not path or path.startswith("/") or CONTROL.search(path):
        return False
    parts = PurePosixPath(path).parts
    return all(part not in (".", "..") for part in parts) and "/".join(parts) == path and parts[0] not in OWN_NAMES
