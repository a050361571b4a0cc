"""What every sandbox module needs from this machine: the error they raise, running a step's
command, an exclusive file lock, process liveness and pid files, mounts and removing a tree that
may have mounts below it, and progress lines on stderr.
"""

from __future__ import annotations

import contextlib
import fcntl
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path


class SandboxError(RuntimeError):
    """A sandbox step failed; the message names the step and what to look at."""


def run_step(step: str, cmd: Sequence[str], *, timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    """Run `cmd` (check=True); a failure raises SandboxError naming the step, command and stderr."""
    try:
        return subprocess.run(list(cmd), check=True, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise SandboxError(f"{step}: `{cmd[0]}` is not installed") from None
    except subprocess.CalledProcessError as err:
        output = (err.stderr or err.stdout or "").strip()
        raise SandboxError(f"{step} failed: `{shlex.join(cmd)}` exited {err.returncode}: {output}") from None
    except subprocess.TimeoutExpired:
        raise SandboxError(f"{step} failed: `{shlex.join(cmd)}` did not finish within {timeout} s") from None


def say(message: str) -> None:
    """Progress for a person watching (stderr, so stdout stays parseable)."""
    print(f"sandbox: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def locked(path: Path, mode: int = fcntl.LOCK_EX) -> Iterator[int]:
    """Hold a flock on `path`, exclusive unless `mode` says LOCK_SH (released on exit, also when
    the process dies); yields its fd, which a child can inherit to hold the lock as long as it lives."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, mode)
        yield handle.fileno()


def tail(path: Path, lines: int = 30) -> str:
    """The last `lines` lines of a log file ('' when it does not exist)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""


def read_lines(path: Path) -> list[str]:
    """Non-empty lines of a file ([] when missing)."""
    try:
        return [line for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def alive(pid: int | None) -> bool:
    """Whether `pid` is a running (not zombie) process."""
    if pid is None:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def read_pid(path: Path) -> int | None:
    """The pid in a pid file (None if missing or not yet written)."""
    try:
        return int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def mounts_under(path: Path) -> list[Path]:
    """Mount points at or below `path` (deepest first), from /proc/self/mountinfo."""
    prefix = str(path)
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == prefix or point.startswith(prefix + "/"):
            found.append(Path(point))
    return sorted(set(found), key=lambda p: len(p.parts), reverse=True)


def unmount_all(path: Path) -> None:
    """Unmount everything at or below `path`; lazily when a plain umount is refused."""
    for point in mounts_under(path):
        if subprocess.run(["umount", str(point)], check=False, capture_output=True).returncode != 0:
            run_step(f"unmount {point}", ["umount", "-l", str(point)])


def remove_tree(path: Path) -> None:
    """rm -rf `path`, but never through a mount point (a killed debootstrap leaves /proc, /dev...)."""
    unmount_all(path)
    if mounts_under(path):
        raise SandboxError(f"refusing to delete {path}: mounts remain below it: {mounts_under(path)}")
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
