"""The suite leaves the machine as it found it.

- `clear_leftovers`, at the start of a run (the controller, before any xdist worker): what a run
  that was killed left behind goes, and only the suite's own by its names: sandboxes named as
  `sandbox_name` names them (machine, network, mounts, cgroups, overlay layers, hub and alert
  receiver) and temp folders `sparkform-test-*`. Every run holds RUN_LOCK shared while it lasts;
  the clearing needs it exclusive, so a run never clears a concurrent run's sandboxes.
- `MachineState`, the session's check: a snapshot of WATCHED at the start, compared at the end;
  anything created, removed or changed there fails the run, listed.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import stat
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

import pytest

from sparkform.sandbox import registry, stage
from sparkform.sandbox.rootfs import cache_dir
from sparkform.sandbox.system import remove_tree

# Where a test that writes outside its temporary folders would leave its mark (a root's rendered
# file put to its real path, a package installed, a unit enabled). The sandbox cache lives in
# /var/cache, outside all of them.
WATCHED = ("/etc", "/usr/local", "/opt", "/var/lib")
TEMP_PREFIX = "sparkform-test-"
SANDBOX_NAME = re.compile(r"t-[0-9a-f]{8}(-[a-z]+)?")
RUN_LOCK = registry.RUNTIME_ROOT / ".test-run.lock"


def sandbox_name(role: str = "") -> str:
    """A fresh name for a test's sandbox, in the pattern a later run clears as a leftover."""
    return f"t-{uuid.uuid4().hex[:8]}{f'-{role}' if role else ''}"


def temp_folder(kind: str) -> Path:
    """A fresh temp folder for state a test session shares (named so a later run clears it)."""
    return Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{kind}-"))


def hold_run_lock() -> tuple[IO[str], bool]:
    """RUN_LOCK held shared for as long as the returned file stays open, and whether this run is
    the only one (it held the lock exclusively first)."""
    RUN_LOCK.parent.mkdir(parents=True, exist_ok=True)
    handle = open(RUN_LOCK, "a")  # held for the run's whole life
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        alone = True
    except BlockingIOError:
        alone = False
    fcntl.flock(handle, fcntl.LOCK_SH)
    return handle, alone


def leftover_sandboxes(runtime_root: Path, layers_root: Path) -> list[str]:
    """The suite's sandbox names that are up, died without `down`, or left only their layers."""
    names = {p.name for root in (runtime_root, layers_root) if root.is_dir() for p in root.iterdir()}
    return sorted(name for name in names if SANDBOX_NAME.fullmatch(name))


def clear_leftovers(temp_root: Path | None = None) -> list[str]:
    """Remove what killed runs of the suite left; returns what went, for the log."""
    gone = []
    layers_root = cache_dir() / "sandboxes"
    for name in leftover_sandboxes(registry.RUNTIME_ROOT, layers_root):
        stage.down(name)  # a no-op for the machine when only layers are left
        remove_tree(layers_root / name)
        gone.append(f"sandbox {name}")
    for folder in sorted(Path(temp_root or tempfile.gettempdir()).glob(f"{TEMP_PREFIX}*")):
        shutil.rmtree(folder, ignore_errors=True)
        gone.append(str(folder))
    return gone


def entries(roots: Iterable[str]) -> Iterator[tuple[str, tuple]]:
    """(path, what identifies its state) of every entry under `roots`, links not followed: a
    file's type, mode, owner, size and mtime, a link's target, a folder's mode and owner."""
    for root in roots:
        for folder, dirs, files in os.walk(root):
            for name in (*dirs, *files):
                path = os.path.join(folder, name)
                try:
                    info = os.lstat(path)
                except FileNotFoundError:
                    continue
                kind = stat.S_IFMT(info.st_mode)
                owner = (stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid)
                if kind == stat.S_IFDIR:
                    yield path, ("dir", *owner)
                elif kind == stat.S_IFLNK:
                    yield path, ("link", os.readlink(path))
                else:
                    yield path, (kind, *owner, info.st_size, info.st_mtime_ns)


def changes(before: dict[str, tuple], after: dict[str, tuple]) -> list[str]:
    """What differs between two snapshots, one line a path."""
    lines = [f"created {path}" for path in sorted(after.keys() - before.keys())]
    lines += [f"removed {path}" for path in sorted(before.keys() - after.keys())]
    lines += [f"changed {path}" for path in sorted(before.keys() & after.keys()) if before[path] != after[path]]
    return lines


class MachineState:
    """The session's check that nothing under WATCHED changed."""

    def __init__(self, roots: Iterable[str] = WATCHED) -> None:
        self.roots = tuple(roots)
        self.before = dict(entries(self.roots))
        self.found: list[str] = []

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.found = changes(self.before, dict(entries(self.roots)))
        if self.found:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.found:
            terminalreporter.section("the suite changed the machine", red=True)
            for line in self.found[:200]:
                terminalreporter.write_line(line)
            terminalreporter.write_line(f"{len(self.found)} change(s) under {', '.join(self.roots)}: the run fails")
