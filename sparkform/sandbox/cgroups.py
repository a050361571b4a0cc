"""A sandbox's cgroup folders: one named PREFIX + NAME under this process's own cgroup in every
mounted hierarchy (v1 controllers, name=systemd, v2), holding the container and everything it
starts, so that `down` can kill it and remove it as a whole.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from sparkform.sandbox.registry import system_name
from sparkform.sandbox.system import SandboxError

# How long processes and cgroup folders get to go away once killed.
KILL_TIMEOUT_S = 10.0


def own_cgroups() -> list[Path]:
    """This process's cgroup folder in every mounted hierarchy (v1 controllers, name=systemd, v2)."""
    mounts: dict[str, tuple[str, str]] = {}  # controller or "" (v2) -> (mount root, mount point)
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        before, after = line.split(" - ", 1)
        fstype, _source, options = after.split()[:3]
        root, point = before.split()[3:5]
        if fstype == "cgroup2":
            mounts.setdefault("", (root, point))
        elif fstype == "cgroup":
            for option in options.split(","):
                mounts.setdefault(option, (root, point))
    folders = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _hid, controllers, path = line.split(":", 2)
        mount = mounts.get(controllers.split(",")[0])
        if mount is None or not (path + "/").startswith(mount[0].rstrip("/") + "/"):
            continue  # hierarchy not mounted here, or our cgroup lies outside the mounted part
        folders.append(Path(mount[1] + "/" + path[len(mount[0].rstrip("/")) :].lstrip("/")))
    return folders


def create_cgroups(name: str) -> list[Path]:
    """Folders PREFIX + NAME under our own cgroups: the container gets its own subtree everywhere
    (its cgroup namespace root), which `down` can kill and remove as a whole."""
    created = []
    for parent in own_cgroups():
        folder = parent / system_name(name)
        folder.mkdir(exist_ok=True)
        created.append(folder)
        # A new v1 cpuset starts empty and refuses tasks until it has CPUs and memory nodes.
        for knob in ("cpuset.cpus", "cpuset.mems"):
            if (folder / knob).exists() and not (folder / knob).read_text().strip():
                (folder / knob).write_text((parent / knob).read_text())
    return created


def cgroup_pids(folder: Path) -> set[int]:
    """Every process in cgroup `folder` and below."""
    pids: set[int] = set()
    for here, _dirs, _files in os.walk(folder):
        with contextlib.suppress(FileNotFoundError):
            pids |= {int(p) for p in Path(here, "cgroup.procs").read_text().split()}
    return pids


def kill_cgroup(folder: Path) -> None:
    """SIGKILL everything in cgroup `folder` at once where the kernel can (v2's cgroup.kill)."""
    if (folder / "cgroup.kill").exists():
        (folder / "cgroup.kill").write_text("1")


def remove_cgroup(folder: Path) -> None:
    """rmdir a cgroup folder and its children, deepest first (retrying while the kernel lets go)."""
    if not folder.exists():
        return
    deadline = time.monotonic() + KILL_TIMEOUT_S
    for here, _dirs, _files in os.walk(folder, topdown=False):
        while True:
            try:
                os.rmdir(here)
                break
            except FileNotFoundError:
                break
            except OSError as err:  # EBUSY while the last tasks are being released
                if time.monotonic() > deadline:
                    raise SandboxError(f"cannot remove cgroup folder {here}: {err}") from None
                time.sleep(0.05)
