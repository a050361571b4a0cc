"""Which sandboxes exist, and where each one keeps its state: name -> runtime folder, link index, pids.

A sandbox NAME is up (or died without `down`) while its runtime folder holds an `index` file:
  /run/sparkform-sandbox/NAME/      index (the link index N, 1..250), up.pid (held by the process
                                    running `up` until the machine booted), supervisor.pid,
                                    nspawn.pid, ssh_config, id_ed25519, known_hosts, ctl (the SSH
                                    ControlPath), nspawn.log, cgroups and layers (what `down`
                                    removes), cable (the pair's cable to another sandbox, as
                                    `link` laid it), root/ (the overlay's mount point, the guest's /)
On this machine the sandbox's netns, container machine name, SSH Host alias, overlay and cgroup
folders are all named PREFIX + NAME, and its link's host-side interface PREFIX + N.
"""

from __future__ import annotations

import re
from pathlib import Path

from sparkform.sandbox.system import SandboxError, alive, read_pid

PREFIX = "sfsb-"
RUNTIME_ROOT = Path("/run/sparkform-sandbox")
# Held while a name is claimed (`up`) or released (`down`), so two processes never pick one index.
REGISTRY_LOCK = RUNTIME_ROOT / ".lock"
MAX_INDEX = 250
NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9-]{0,29}")


def check_name(name: str) -> None:
    """Reject names that do not fit a netns, a machine name and a cgroup folder."""
    if not NAME_PATTERN.fullmatch(name):
        raise SandboxError(f"bad sandbox name {name!r}: use 1-30 of a-z, 0-9 and '-', starting with a letter or digit")


def runtime_dir(name: str) -> Path:
    """The runtime folder of sandbox `name`."""
    return RUNTIME_ROOT / name


def system_name(name: str) -> str:
    """What sandbox `name` is called on this machine (netns, machine name, SSH alias, cgroups)."""
    return f"{PREFIX}{name}"


def names() -> list[str]:
    """Sandboxes that were brought up and not taken down (`status` says whether each still runs)."""
    if not RUNTIME_ROOT.is_dir():
        return []
    return sorted(p.name for p in RUNTIME_ROOT.iterdir() if (p / "index").is_file())


def read_index(runtime_dir: Path) -> int:
    """The link index N of the sandbox with runtime folder `runtime_dir` (see network.addresses)."""
    return int((runtime_dir / "index").read_text())


def free_index() -> int:
    """The first index 1..MAX_INDEX no other sandbox holds."""
    taken = {read_index(runtime_dir(other)) for other in names()}
    for index in range(1, MAX_INDEX + 1):
        if index not in taken:
            return index
    raise SandboxError(f"all {MAX_INDEX} sandbox slots are taken: `down` some of {names()}")


def owned_pid(runtime_dir: Path, filename: str) -> int | None:
    """The pid in runtime_dir/filename if that process is alive and belongs to this sandbox (its
    command line names the runtime folder), else None: a stale pid file may point to a reused pid."""
    pid = read_pid(runtime_dir / filename)
    if not alive(pid):
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except FileNotFoundError:
        return None
    return pid if str(runtime_dir) in cmdline else None


def in_use(runtime_dir: Path) -> bool:
    """Whether a live process holds the sandbox: its supervisor, its systemd-nspawn, or the `up`
    that claimed the name and is still booting it."""
    return bool(
        owned_pid(runtime_dir, "nspawn.pid")
        or owned_pid(runtime_dir, "supervisor.pid")
        or alive(read_pid(runtime_dir / "up.pid"))
    )
