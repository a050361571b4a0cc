"""A file replaced whole: its text goes to a new file beside it, reaches the disk, then is renamed
over it. Readers see the old file or the new one, never part of one; nothing is written through a
link planted at either name (the new file is made afresh, O_EXCL, in the same root-only folder);
and a write that fails (a full disk, a read-only or missing folder) raises OSError and leaves no
temp file behind."""

import contextlib
import os
import tempfile


def replaced(path, text, mode=0o600):
    """Write `text` (str or bytes) to `path` whole, with permissions `mode`."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    descriptor, temp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=f".{os.path.basename(path)}.")
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temp, mode)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
