"""A sandbox machine's life: a disposable Debian host with real systemd as PID 1
(systemd-nspawn), reached over SSH.

`up(name)` boots a machine from the cached rootfs (sparkform.sandbox.rootfs; the read-only lower
layer of a fresh overlay whose upper and work folders live in the cache, on disk: a vLLM venv in
the guest is several GB), in its own network namespace with a /30 link to this machine, and
returns a `Sandbox` with everything an SSH client needs; `get(name)` loads that value in another
process. `reboot(name)` reboots the guest and waits until the same machine (same upper layer,
keys and address) is back, re-applying `memory_controller_writable`. `link(name, peer)` lays the
pair's direct cable between two machines that are up (sparkform.sandbox.network). `status(name)`
says whether it runs, and its cable. `down(name)` powers it off and removes every trace
(processes, mounts, netns, its cable and both sides' record of it, cgroup folders, files).

`up` of a name that is up is an error (SandboxError); `down` of a name that is not up is a no-op.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkform.sandbox import cgroups, network, nspawn, registry
from sparkform.sandbox.rootfs import build_rootfs, cache_dir, hosts_file
from sparkform.sandbox.system import (
    SandboxError,
    alive,
    locked,
    read_lines,
    read_pid,
    remove_tree,
    run_step,
    say,
    unmount_all,
)

KEYGEN = ("ssh-keygen", "-q", "-t", "ed25519", "-N", "")
BOOT_TIMEOUT_S = 60.0
# A reboot ends when every enabled unit started: on a converged sandbox that includes both
# engines, one after the other, each to readiness (minutes on two cores).
REBOOT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Sandbox:
    """A running sandbox machine, as an SSH client sees it."""

    name: str
    address: str  # the guest's side of the link
    # This machine's side of the link: services bound to it are reachable from the guest.
    host_address: str
    runtime_dir: Path
    ssh_config: Path
    ssh_key: Path
    known_hosts: Path
    # Seconds `up` took (0.0 when the object was loaded by `get`).
    up_seconds: float = field(default=0.0, compare=False)

    @property
    def host_alias(self) -> str:
        """The Host entry of `ssh_config` (also the container's machine name)."""
        return registry.system_name(self.name)

    def ssh_args(self) -> list[str]:
        """The start of an ssh command line for subprocess; append the remote command."""
        return ["ssh", "-F", str(self.ssh_config), self.host_alias]


def get(name: str) -> Sandbox:
    """The Sandbox of a machine that is up (for a process other than the one that ran `up`)."""
    registry.check_name(name)
    runtime_dir = registry.runtime_dir(name)
    if not (runtime_dir / "ssh_config").is_file():
        raise SandboxError(f"sandbox {name!r} is not up (no {runtime_dir}/ssh_config)")
    return _sandbox(name, runtime_dir)


def _sandbox(name: str, runtime_dir: Path, up_seconds: float = 0.0) -> Sandbox:
    """The Sandbox value for runtime folder `runtime_dir`."""
    host_side, guest_side = network.addresses(registry.read_index(runtime_dir))
    return Sandbox(
        name=name,
        address=guest_side,
        host_address=host_side,
        runtime_dir=runtime_dir,
        ssh_config=runtime_dir / "ssh_config",
        ssh_key=runtime_dir / "id_ed25519",
        known_hosts=runtime_dir / "known_hosts",
        up_seconds=up_seconds,
    )


# ---------------------------------------------------------------------------------------------
# up


def up(
    name: str = "sandbox",
    binds: Sequence[tuple[str, str]] = (),
    *,
    extra_packages: Sequence[str] = (),
    layers: Sequence[Path] = (),
    boot_timeout: float = BOOT_TIMEOUT_S,
) -> Sandbox:
    """Boot machine `name` from the cached rootfs and wait until systemd is running (or degraded).

    `binds` are (host path, guest path) pairs bound read-only. `layers` are folders laid over the
    rootfs, read-only, the first topmost (a prebuilt venv, say): the guest sees their files as its
    own. A name that is already up is an error; the remains of one that died without `down` are
    cleared first.
    """
    registry.check_name(name)
    binds = [(str(host_path), str(guest_path)) for host_path, guest_path in binds]
    for host_path, guest_path in binds:
        if ":" in host_path + guest_path or not Path(host_path).exists() or not guest_path.startswith("/"):
            raise SandboxError(
                f"bad bind {host_path!r} -> {guest_path!r}: need an existing host path and an absolute"
                " guest path, no ':'"
            )
    for layer in layers:
        if ":" in str(layer) or not Path(layer).is_dir():
            raise SandboxError(f"bad layer {str(layer)!r}: need an existing folder, no ':'")
    rootfs = build_rootfs(extra_packages)
    started = time.monotonic()
    runtime_dir = registry.runtime_dir(name)
    with locked(registry.REGISTRY_LOCK):
        if runtime_dir.exists():
            if registry.in_use(runtime_dir):
                raise SandboxError(
                    f"sandbox {name!r} is already up (or coming up): "
                    f"`ssh -F {runtime_dir}/ssh_config {registry.system_name(name)}`; `down` it first"
                )
            _teardown(name)  # the remains of a sandbox that died without `down`
        index = registry.free_index()
        runtime_dir.mkdir(parents=True)
        (runtime_dir / "index").write_text(f"{index}\n")
        (runtime_dir / "up.pid").write_text(f"{os.getpid()}\n")  # claims the name until booted
    try:
        _start(name, runtime_dir, [*map(Path, layers), rootfs], binds)
        state = _wait_running(name, runtime_dir, time.monotonic() + boot_timeout)
    except BaseException:
        down(name)
        raise
    (runtime_dir / "up.pid").unlink()
    box = _sandbox(name, runtime_dir, time.monotonic() - started)
    say(f"{name} is up ({state}) at {box.address} in {box.up_seconds:.2f} s; ssh -F {box.ssh_config} {box.host_alias}")
    return box


def _start(name: str, runtime_dir: Path, lower: Sequence[Path], binds: Sequence[tuple[str, str]]) -> None:
    """Mount the overlay (`lower`: its read-only layers, topmost first), give the guest its keys,
    make its network and cgroups, boot it."""
    layers = cache_dir() / "sandboxes" / name
    remove_tree(layers)
    (layers / "upper").mkdir(parents=True)
    (layers / "work").mkdir()
    (runtime_dir / "layers").write_text(f"{layers}\n")
    merged = runtime_dir / "root"
    merged.mkdir()
    run_step(
        "mount the overlay",
        [
            "mount",
            "-t",
            "overlay",
            registry.system_name(name),
            "-o",
            f"lowerdir={':'.join(map(str, lower))},upperdir={layers / 'upper'},workdir={layers / 'work'}",
            str(merged),
        ],
    )
    index = registry.read_index(runtime_dir)
    _personalize(name, runtime_dir, merged, network.addresses(index)[1])
    network.create_network(name, index)
    folders = cgroups.create_cgroups(name)
    (runtime_dir / "cgroups").write_text("".join(f"{d}\n" for d in folders))
    nspawn.start(name, runtime_dir, merged, binds, folders)


def _personalize(name: str, runtime_dir: Path, merged: Path, address: str) -> None:
    """Write this machine's host key, client key, machine id and hostname, and its ssh files."""
    alias = registry.system_name(name)
    host_key = merged / "etc/ssh/ssh_host_ed25519_key"
    run_step("make the guest's host key", [*KEYGEN, "-C", alias, "-f", str(host_key)])
    client_key = runtime_dir / "id_ed25519"
    run_step("make the client key", [*KEYGEN, "-C", f"sparkform@{alias}", "-f", str(client_key)])
    authorized = merged / "root/.ssh/authorized_keys"
    authorized.parent.mkdir(mode=0o700, exist_ok=True)
    authorized.write_text(Path(f"{client_key}.pub").read_text())
    authorized.chmod(0o600)
    # A machine id of its own, so journald and D-Bus do not see every sandbox as one machine.
    (merged / "etc/machine-id").write_text(uuid.uuid4().hex + "\n")
    (merged / "etc/hostname").write_text(f"{name}\n")
    (merged / "etc/hosts").write_text(hosts_file(name))
    key_type, key_body = Path(f"{host_key}.pub").read_text().split()[:2]
    (runtime_dir / "known_hosts").write_text(f"{address} {key_type} {key_body}\n")
    (runtime_dir / "ssh_config").write_text(
        f"Host {alias}\n"
        f"  HostName {address}\n"
        "  User root\n"
        f"  IdentityFile {client_key}\n"
        "  IdentitiesOnly yes\n"
        f"  UserKnownHostsFile {runtime_dir / 'known_hosts'}\n"
        "  GlobalKnownHostsFile /dev/null\n"
        "  StrictHostKeyChecking yes\n"
        "  BatchMode yes\n"
        "  ConnectTimeout 5\n"
        "  LogLevel ERROR\n"
        "  ControlMaster auto\n"
        f"  ControlPath {runtime_dir / 'ctl'}\n"
        "  ControlPersist 60\n"
    )


def _wait_running(name: str, runtime_dir: Path, deadline: float) -> str:
    """Wait until `systemctl is-system-running --wait` over SSH says running or degraded."""
    sandbox = _sandbox(name, runtime_dir)
    last = "no answer yet"
    while time.monotonic() < deadline:
        if read_pid(runtime_dir / "supervisor.pid") and not registry.owned_pid(runtime_dir, "supervisor.pid"):
            raise SandboxError(
                f"sandbox {name!r}: systemd-nspawn stopped while booting; {nspawn.log_tail(runtime_dir)}"
            )
        try:
            answer = subprocess.run(
                [*sandbox.ssh_args(), "systemctl", "is-system-running", "--wait"],
                check=False,
                capture_output=True,
                text=True,
                timeout=max(1.0, deadline - time.monotonic()),
            )
        except subprocess.TimeoutExpired:
            last = f"systemd still starting units; {_pending_jobs(sandbox)}"
            break
        state = answer.stdout.strip()
        if state in ("running", "degraded"):
            return state
        last = state or answer.stderr.strip() or f"ssh exited {answer.returncode}"
        time.sleep(0.05)
    raise SandboxError(
        f"sandbox {name!r} did not reach running/degraded in time (last: {last}); "
        f"{nspawn.log_tail(runtime_dir)}\n{nspawn.guest_journal(runtime_dir)}"
    )


def _pending_jobs(sandbox: Sandbox) -> str:
    """The guest's queued start jobs: what a boot that does not finish is waiting for."""
    try:
        jobs = subprocess.run(
            [*sandbox.ssh_args(), "systemctl", "list-jobs", "--no-pager", "--no-legend"],
            check=False,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except subprocess.TimeoutExpired:
        return "`systemctl list-jobs` did not answer either"
    return f"jobs: {'; '.join(jobs.stdout.strip().splitlines()) or jobs.stderr.strip() or 'none'}"


# ---------------------------------------------------------------------------------------------
# reboot, memory controller, status


def reboot(name: str, timeout: float = REBOOT_TIMEOUT_S) -> float:
    """Reboot the guest and wait until the same machine finished booting; returns the seconds it took.

    The supervisor boots the same overlay again (same files, keys and address). The boot ends when
    every enabled unit started, engines included. A memory controller made writable before is
    made writable again.
    """
    sandbox = get(name)
    runtime_dir = sandbox.runtime_dir
    before = registry.owned_pid(runtime_dir, "nspawn.pid")
    if before is None:
        raise SandboxError(f"sandbox {name!r} is not running (no live systemd-nspawn); `down` and `up` it")
    started = time.monotonic()
    deadline = started + timeout
    # The connection drops while the guest goes down, so ssh's own status means nothing here.
    subprocess.run([*sandbox.ssh_args(), "systemctl", "reboot"], check=False, capture_output=True, timeout=timeout)
    _close_master(sandbox)
    while alive(before) or registry.owned_pid(runtime_dir, "nspawn.pid") in (None, before):
        if time.monotonic() > deadline or not registry.owned_pid(runtime_dir, "supervisor.pid"):
            raise SandboxError(f"sandbox {name!r} did not boot again after the reboot; {nspawn.log_tail(runtime_dir)}")
        time.sleep(0.05)
    _wait_running(name, runtime_dir, deadline)
    if (runtime_dir / "memory-writable").exists():
        memory_controller_writable(name)
    seconds = time.monotonic() - started
    say(f"{name} rebooted in {seconds:.2f} s")
    return seconds


def memory_controller_writable(name: str) -> None:
    """Make the guest enforce MemoryMax= and friends.

    nspawn mounts the v1 memory controller read-only in the guest, so systemd stores limits but
    cannot apply them. Remount it read-write in the container's mount namespace and re-exec
    systemd so it notices. Nothing to do where the guest has the unified (v2) hierarchy. `reboot`
    repeats this (a reboot mounts it read-only again).
    """
    sandbox = get(name)
    layout = run_step(
        "read the guest's cgroup layout", [*sandbox.ssh_args(), "stat", "-fc", "%T", "/sys/fs/cgroup"], timeout=60
    )
    fs_type = layout.stdout.strip()
    if fs_type != "cgroup2fs":
        init = nspawn.container_init(sandbox.runtime_dir)
        run_step(
            "remount the guest's memory controller read-write",
            ["nsenter", "-t", str(init), "-m", "mount", "-o", "remount,bind,rw", "/sys/fs/cgroup/memory"],
        )
        run_step("re-exec the guest's systemd", [*sandbox.ssh_args(), "systemctl", "daemon-reexec"], timeout=60)
    (sandbox.runtime_dir / "memory-writable").touch()


def status(name: str) -> dict[str, Any]:
    """{name, up, address, pid (systemd-nspawn), state (systemctl is-system-running; None if unreachable),
    cable (network.Cable as a dict, or None)}."""
    registry.check_name(name)
    runtime_dir = registry.runtime_dir(name)
    result: dict[str, Any] = {"name": name, "up": False, "address": None, "pid": None, "state": None, "cable": None}
    if not (runtime_dir / "index").is_file():
        return result
    sandbox = _sandbox(name, runtime_dir)
    pid = registry.owned_pid(runtime_dir, "nspawn.pid")
    cable = network.read_cable(runtime_dir)
    result.update(up=pid is not None, address=sandbox.address, pid=pid, cable=cable and dataclasses.asdict(cable))
    if pid is not None and sandbox.ssh_config.is_file():
        with contextlib.suppress(subprocess.TimeoutExpired):
            answer = subprocess.run(
                [*sandbox.ssh_args(), "systemctl", "is-system-running"],
                check=False,
                capture_output=True,
                text=True,
                timeout=10,
            )
            result["state"] = answer.stdout.strip() or None
    return result


# ---------------------------------------------------------------------------------------------
# the pair's cable


def link(name: str, peer: str) -> network.Cable:
    """Lay the cable between machines `name` and `peer` (both up): `name` holds 10.234.K.1, `peer`
    10.234.K.2, K being `name`'s index; returns `name`'s view of it. Linking a pair that is linked
    changes nothing (either way round); a machine cabled to a third one is an error.
    """
    registry.check_name(name)
    registry.check_name(peer)
    if name == peer:
        raise SandboxError(f"cannot link sandbox {name!r} to itself: name another sandbox that is up")
    with locked(registry.REGISTRY_LOCK):
        here, there = registry.runtime_dir(name), registry.runtime_dir(peer)
        for side, folder in ((name, here), (peer, there)):
            if not (folder / "index").is_file() or not registry.in_use(folder):
                raise SandboxError(f"sandbox {side!r} is not up: `sparkform sandbox --name {side} up` it first")
        cables = {side: network.read_cable(folder) for side, folder in ((name, here), (peer, there))}
        for side, other in ((name, peer), (peer, name)):
            cable = cables[side]
            if cable is not None and cable.peer != other:
                raise SandboxError(
                    f"sandbox {side!r} is cabled to {cable.peer!r} (one cable a sandbox, as a Spark's one "
                    f"ConnectX-7 link): `down` one of them, or link {side!r} with {cable.peer!r}"
                )
        kept = cables[name]
        if kept is not None and cables[peer] == kept.seen_from_peer(name) and network.has_cable(name):
            say(f"{name} and {peer} are linked already: {kept}")
            return kept
        _cut(name)  # what a link that failed halfway left, if anything
        cable = network.lay_cable(name, peer, registry.read_index(here))
        network.write_cable(here, cable)
        network.write_cable(there, cable.seen_from_peer(name))
    say(f"{name} and {peer} are linked: {cable}")
    return cable


def _cut(name: str) -> None:
    """Remove machine `name`'s cable, its record and the peer's record of it (caller holds the lock)."""
    runtime_dir = registry.runtime_dir(name)
    try:
        cable = network.read_cable(runtime_dir)
    except SandboxError:
        cable = None  # an unreadable record goes; the peer's own record names its peer
    network.cut_cable(name)
    if cable is not None:
        peer_dir = registry.runtime_dir(cable.peer)
        with contextlib.suppress(SandboxError):
            if (back := network.read_cable(peer_dir)) is not None and back.peer == name:
                (peer_dir / network.CABLE_RECORD).unlink()
    (runtime_dir / network.CABLE_RECORD).unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# down


def down(name: str) -> None:
    """Power machine `name` off and remove all of it; a name that is not up is a no-op."""
    registry.check_name(name)
    if not registry.runtime_dir(name).exists():
        return
    with locked(registry.REGISTRY_LOCK):
        _teardown(name)


def _teardown(name: str) -> None:
    """Stop everything of machine `name` and delete it, whatever state it is in (caller holds the lock)."""
    runtime_dir = registry.runtime_dir(name)
    started = time.monotonic()
    (runtime_dir / "stopping").touch()  # tells the supervisor not to boot again
    if (runtime_dir / "ssh_config").is_file():
        _close_master(_sandbox(name, runtime_dir))
    nspawn.power_off(runtime_dir)
    folders = [Path(line) for line in read_lines(runtime_dir / "cgroups")]
    nspawn.kill_all(runtime_dir, folders)
    leftovers = nspawn.leftover_files(name, runtime_dir)
    unmount_all(runtime_dir)
    layers = [Path(line) for line in read_lines(runtime_dir / "layers")]
    for folder in layers:
        unmount_all(folder)
    _cut(name)
    network.delete_network(name)
    for folder in folders:
        cgroups.remove_cgroup(folder)
    for path in leftovers:
        remove_tree(path)
    for folder in layers:
        remove_tree(folder)
    remove_tree(runtime_dir)
    say(f"{name} is down ({time.monotonic() - started:.2f} s)")


def _close_master(sandbox: Sandbox) -> None:
    """Stop the SSH control master, if one runs (else it would outlive the machine)."""
    if (sandbox.runtime_dir / "ctl").exists():
        subprocess.run([*sandbox.ssh_args(), "-O", "exit"], check=False, capture_output=True, timeout=10)
