"""An engine's kept folder, as sparkform-rollback and the deploy both read it: the names of its
files and the digest of the settings they hold."""

import hashlib
import time

# In ENGINE's kept folder: copies of its files (KEPT_FILES, in the order of the settings'
# "files": unit, env, args), KEPT_RECORD (when, the venv and checkpoint folder, their digest),
# ROLLBACK_RECORD after a rollback, and the settings kept before the last ones in KEPT_PREVIOUS/.
KEPT_FILES = ("unit", "env", "args")
KEPT_RECORD = "kept.json"
KEPT_PREVIOUS = "previous"
ROLLBACK_RECORD = "rolled-back.json"


def settings_digest(contents):
    """The digest of an engine's unit, env and args texts (sparkform.readers.kept.settings_digest)."""
    return hashlib.sha256("\0".join(contents).encode()).hexdigest()[:32]


def day(unix):
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(unix))
