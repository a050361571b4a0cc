"""A disposable Debian host with real systemd as PID 1 (systemd-nspawn), reached over SSH.

Lifecycle: `build_rootfs()` debootstraps a Debian rootfs once into a cache; `up(name)` boots a
container from it (the cached rootfs is the read-only lower layer of a fresh overlay), in its own
network namespace with a /30 link to this machine, and returns a `Sandbox` with everything an SSH
client needs; `down(name)` powers it off and removes every trace (processes, mounts, netns,
cgroup folders, files). `reboot(name)` reboots the guest and waits until the same sandbox (same
upper layer, keys and address) is back.

Layout of one sandbox NAME with index N (1..250):
  /run/sparkform-sandbox/NAME/      runtime folder: ssh_config, id_ed25519, known_hosts, ctl (the
                                    SSH ControlPath), nspawn.log, pid files, index, cgroups,
                                    root/ (the overlay's mount point, the guest's /)
  $CACHE/sandboxes/NAME/            the overlay's upper and work folders (on disk, not in /run:
                                    a vLLM venv in the guest is several GB)
  netns sfsb-NAME                   host side `sfsb-N` 10.233.N.1/30, guest side `eth0`
                                    10.233.N.2/30 with a default route via 10.233.N.1
  cgroup folders sfsb-NAME          one under this process's own cgroup in every hierarchy

Reboot: systemd-nspawn exits with status 133 when the guest reboots; a small shell supervisor
runs it in a loop and boots the same overlay again on 133 (any other status ends the sandbox).
So a reboot from inside (`systemctl reboot`, pyinfra's server.reboot) also brings it back; only
`reboot(name)` also re-applies `memory_controller_writable`.

`up` of a name that is up is an error (SandboxError); `down` of a name that is not up is a no-op.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

SUITE = "bookworm"
BASE_PACKAGES = (
    "systemd", "systemd-sysv", "dbus", "libpam-systemd", "openssh-server", "python3",
    "python3-venv", "curl", "iproute2", "sudo", "util-linux", "gawk", "procps", "ca-certificates",
)
# Bump when the rootfs recipe (packages aside) changes, so old caches are not reused.
ROOTFS_FORMAT = 1
DEFAULT_CACHE = Path("/var/cache/sparkform-sandbox")
RUNTIME_ROOT = Path("/run/sparkform-sandbox")
NETNS_DIR = Path("/run/netns")
NSPAWN_RUN = Path("/run/systemd/nspawn")
GUEST_INTERFACE = "eth0"
KEYGEN = ("ssh-keygen", "-q", "-t", "ed25519", "-N", "")
MAX_INDEX = 250
NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9-]{0,29}")
BOOT_TIMEOUT_S = 60.0
# A reboot ends when every enabled unit started: on a converged sandbox that includes both
# engines, one after the other, each to readiness (minutes on two cores).
REBOOT_TIMEOUT_S = 600.0
POWEROFF_TIMEOUT_S = 15.0
KILL_TIMEOUT_S = 10.0
# Units that are useless in a container or slow its boot; masked in the rootfs.
MASKED_UNITS = (
    "console-getty.service", "container-getty@.service", "getty@.service",
    "serial-getty@.service", "getty.target",
    "systemd-networkd-wait-online.service", "ifupdown-wait-online.service",
    "apt-daily.timer", "apt-daily-upgrade.timer", "dpkg-db-backup.timer",
    "e2scrub_all.timer", "e2scrub_reap.service", "fstrim.timer", "man-db.timer",
    "systemd-timesyncd.service",
)
SSHD_CONFIG = """\
# sparkform sandbox: root by key only, one host key (written per sandbox before boot).
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
HostKey /etc/ssh/ssh_host_ed25519_key
UseDNS no
"""
# Runs systemd-nspawn ("$@") and boots it again when the guest rebooted (exit status 133),
# unless `down` is under way. It moves itself into the sandbox's cgroup folders first, so the
# container and everything it starts live there.
SUPERVISOR_SH = """\
rt=$1; shift
echo $$ > "$rt/supervisor.pid"
for procs in $SFSB_CGROUP_PROCS; do echo $$ > "$procs" || exit 1; done
while :; do
  "$@" &
  echo $! > "$rt/nspawn.pid"
  wait $!
  rc=$?
  if [ "$rc" -ne 133 ] || [ -e "$rt/stopping" ]; then
    echo "sfsb-supervisor: systemd-nspawn exited $rc"
    exit "$rc"
  fi
  echo "sfsb-supervisor: the guest rebooted; booting it again"
done
"""


class SandboxError(RuntimeError):
    """A sandbox step failed; the message names the step and what to look at."""


@dataclass(frozen=True)
class Sandbox:
    """A running sandbox, as an SSH client sees it."""

    name: str
    address: str
    runtime_dir: Path
    ssh_config: Path
    ssh_key: Path
    known_hosts: Path
    # Seconds `up` took (0.0 when the object was loaded by `get`).
    up_seconds: float = field(default=0.0, compare=False)

    @property
    def host_alias(self) -> str:
        """The Host entry of `ssh_config` (also the container's machine name)."""
        return f"sfsb-{self.name}"

    @property
    def host_address(self) -> str:
        """This machine's address on the sandbox's link: services bound to it are reachable from the guest."""
        return self.address.rsplit(".", 1)[0] + ".1"

    def ssh_args(self) -> list[str]:
        """The start of an ssh command line for subprocess; append the remote command."""
        return ["ssh", "-F", str(self.ssh_config), self.host_alias]


# ---------------------------------------------------------------------------------------------
# small helpers


def _run(step: str, cmd: Sequence[str], *, timeout: float | None = None) -> subprocess.CompletedProcess[str]:
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


def _say(message: str) -> None:
    """Progress for a person watching (stderr, so stdout stays parseable)."""
    print(f"sandbox: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[int]:
    """Hold an exclusive flock on `path` (released on exit, also when the process dies); yields
    its fd, which a child can inherit to hold the lock as long as it lives."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield handle.fileno()


def _tail(path: Path, lines: int = 30) -> str:
    """The last `lines` lines of a log file ('' when it does not exist)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""


def _log_tail(rt: Path) -> str:
    """'end of NSPAWN LOG:' and its last lines, for error messages."""
    return f"end of {rt / 'nspawn.log'}:\n{_tail(rt / 'nspawn.log')}"


def _hosts_file(hostname: str) -> str:
    """An /etc/hosts that resolves `hostname` (sudo complains otherwise)."""
    return f"127.0.0.1 localhost\n127.0.1.1 {hostname}\n::1 localhost ip6-localhost ip6-loopback\n"


def _alive(pid: int | None) -> bool:
    """Whether `pid` is a running (not zombie) process."""
    if pid is None:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _mounts_under(path: Path) -> list[Path]:
    """Mount points at or below `path` (deepest first), from /proc/self/mountinfo."""
    prefix = str(path)
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == prefix or point.startswith(prefix + "/"):
            found.append(Path(point))
    return sorted(set(found), key=lambda p: len(p.parts), reverse=True)


def _unmount_all(path: Path) -> None:
    """Unmount everything at or below `path`; lazily when a plain umount is refused."""
    for point in _mounts_under(path):
        if subprocess.run(["umount", str(point)], check=False, capture_output=True).returncode != 0:
            _run(f"unmount {point}", ["umount", "-l", str(point)])


def _remove_tree(path: Path) -> None:
    """rm -rf `path`, but never through a mount point (a killed debootstrap leaves /proc, /dev...)."""
    _unmount_all(path)
    if _mounts_under(path):
        raise SandboxError(f"refusing to delete {path}: mounts remain below it: {_mounts_under(path)}")
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# rootfs


def cache_dir() -> Path:
    """Where rootfs builds and overlay layers live ($SPARKFORM_SANDBOX_CACHE or /var/cache/...)."""
    return Path(os.environ.get("SPARKFORM_SANDBOX_CACHE") or DEFAULT_CACHE)


def apt_mirror(suite: str = SUITE, apt_dir: Path = Path("/etc/apt")) -> str:
    """The first Debian mirror URI in this machine's apt sources that serves `suite`."""
    candidates: list[tuple[str, list[str]]] = []
    files = [apt_dir / "sources.list", *sorted((apt_dir / "sources.list.d").glob("*.list"))]
    for path in files:
        if path.is_file():
            candidates += _one_line_sources(path.read_text())
    for path in sorted((apt_dir / "sources.list.d").glob("*.sources")):
        candidates += _deb822_sources(path.read_text())
    for uri, suites in candidates:
        if suite in suites:
            return uri
    raise SandboxError(
        f"no apt source for Debian {suite!r} in {apt_dir}/sources.list or {apt_dir}/sources.list.d/"
        " (*.list, *.sources): debootstrap needs a mirror; add one, e.g. "
        f"'deb http://deb.debian.org/debian {suite} main'"
    )


def _one_line_sources(text: str) -> list[tuple[str, list[str]]]:
    """(uri, [suite]) of each `deb [options] URI SUITE COMPONENTS...` line."""
    found = []
    for line in text.splitlines():
        match = re.match(r"\s*deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+)", line.split("#", 1)[0])
        if match:
            found.append((match.group(1), [match.group(2)]))
    return found


def _deb822_sources(text: str) -> list[tuple[str, list[str]]]:
    """(uri, suites) of each enabled `Types: deb` paragraph of a deb822 .sources file."""
    found = []
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    for paragraph in re.split(r"\n\s*\n", "\n".join(lines)):
        fields: dict[str, str] = {}
        key = None
        for line in paragraph.splitlines():
            if line[:1].isspace() and key:  # continuation of a multi-line field
                fields[key] += " " + line.strip()
            elif ":" in line:
                key, value = line.split(":", 1)
                key = key.strip().lower()
                fields[key] = value.strip()
        if "deb" not in fields.get("types", "").split() or fields.get("enabled", "yes").lower() == "no":
            continue
        suites = fields.get("suites", "").split()
        found += [(uri, suites) for uri in fields.get("uris", "").split()]
    return found


def rootfs_key(packages: Sequence[str], suite: str = SUITE) -> str:
    """A short hash of what makes a rootfs: format version, suite and package list."""
    text = f"{ROOTFS_FORMAT}\n{suite}\n" + "\n".join(sorted(set(packages)))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def build_rootfs(extra_packages: Sequence[str] = ()) -> Path:
    """The cached rootfs with the base packages plus `extra_packages`; debootstraps it if missing.

    Built in a temporary folder and renamed into place only when complete, so an interrupted
    build is never taken for a finished one (the next build removes its remains).
    """
    packages = sorted(set(BASE_PACKAGES) | set(extra_packages))
    cache = cache_dir()
    key = rootfs_key(packages)
    rootfs = cache / f"rootfs-{key}"
    if rootfs.is_dir():
        return rootfs
    with _locked(cache / f".rootfs-{key}.lock") as lock_fd:
        if rootfs.is_dir():  # another process finished it while we waited for the lock
            return rootfs
        # Holding the lock, any build folder left here belongs to a build that died (debootstrap
        # inherits the lock, so one that outlived its parent still holds it).
        building = cache / f".building-rootfs-{key}"
        _remove_tree(building)
        mirror = apt_mirror()
        log = cache / f".building-rootfs-{key}.log"
        _say(f"building the rootfs with debootstrap ({SUITE}, {mirror}); this takes 1-2 min; log: {log}")
        started = time.monotonic()
        _debootstrap(building, packages, mirror, log, lock_fd)
        _bake(building)
        building.rename(rootfs)
        log.unlink(missing_ok=True)
        _say(f"rootfs ready in {time.monotonic() - started:.0f} s: {rootfs}")
    return rootfs


def _debootstrap(target: Path, packages: Sequence[str], mirror: str, log: Path, lock_fd: int) -> None:
    """debootstrap a minbase `SUITE` with `packages` into `target` (output to `log`), holding
    the build lock `lock_fd` for as long as debootstrap runs."""
    cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(packages)}", SUITE, str(target), mirror]
    target.mkdir(parents=True)
    try:
        with open(log, "w") as out:
            code = subprocess.run(
                cmd, check=False, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, pass_fds=[lock_fd],
            ).returncode
    except FileNotFoundError:
        raise SandboxError("build rootfs: `debootstrap` is not installed (apt-get install debootstrap)") from None
    if code != 0:
        raise SandboxError(f"build rootfs failed: `{shlex.join(cmd)}` exited {code}; end of {log}:\n{_tail(log)}")


def _bake(root: Path) -> None:
    """Configure a fresh rootfs for life as a container reached over SSH."""
    _run("enable ssh in the rootfs", ["systemctl", f"--root={root}", "enable", "ssh.service"])
    for unit in MASKED_UNITS:
        link = root / "etc/systemd/system" / unit
        link.unlink(missing_ok=True)
        link.symlink_to("/dev/null")
    (root / "etc/ssh/sshd_config.d/sparkform-sandbox.conf").write_text(SSHD_CONFIG)
    for host_key in (root / "etc/ssh").glob("ssh_host_*"):  # each sandbox gets its own
        host_key.unlink()
    (root / "etc/hostname").write_text("sandbox\n")
    (root / "etc/hosts").write_text(_hosts_file("sandbox"))
    (root / "root/.ssh").mkdir(mode=0o700, exist_ok=True)
    for deb in (root / "var/cache/apt/archives").glob("*.deb"):
        deb.unlink()


# ---------------------------------------------------------------------------------------------
# one sandbox: names and files


def _check_name(name: str) -> None:
    """Reject names that do not fit a netns, a machine name and a cgroup folder."""
    if not NAME_PATTERN.fullmatch(name):
        raise SandboxError(f"bad sandbox name {name!r}: use 1-30 of a-z, 0-9 and '-', starting with a letter or digit")


def runtime_dir(name: str) -> Path:
    """The runtime folder of sandbox `name`."""
    return RUNTIME_ROOT / name


def netns_name(name: str) -> str:
    """The network namespace of sandbox `name`."""
    return f"sfsb-{name}"


def _read_pid(path: Path) -> int | None:
    """The pid in a pid file (None if missing or not yet written)."""
    try:
        return int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def _owned_pid(rt: Path, filename: str) -> int | None:
    """The pid in rt/filename if that process is alive and belongs to this sandbox (its command
    line names the runtime folder), else None: a stale pid file may point to a reused pid."""
    pid = _read_pid(rt / filename)
    if not _alive(pid):
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except FileNotFoundError:
        return None
    return pid if str(rt) in cmdline else None


def names() -> list[str]:
    """Sandboxes that were brought up and not taken down (`status` says whether each still runs)."""
    if not RUNTIME_ROOT.is_dir():
        return []
    return sorted(p.name for p in RUNTIME_ROOT.iterdir() if (p / "index").is_file())


def _index(rt: Path) -> int:
    """The link index N of a sandbox (its addresses are 10.233.N.1/2)."""
    return int((rt / "index").read_text())


def _free_index() -> int:
    """The first index 1..MAX_INDEX no other sandbox holds."""
    taken = {_index(runtime_dir(other)) for other in names()}
    for index in range(1, MAX_INDEX + 1):
        if index not in taken:
            return index
    raise SandboxError(f"all {MAX_INDEX} sandbox slots are taken: `down` some of {names()}")


def get(name: str) -> Sandbox:
    """The Sandbox of a sandbox that is up (for a process other than the one that ran `up`)."""
    _check_name(name)
    rt = runtime_dir(name)
    if not (rt / "ssh_config").is_file():
        raise SandboxError(f"sandbox {name!r} is not up (no {rt}/ssh_config)")
    return _sandbox(name, rt)


def _sandbox(name: str, rt: Path, up_seconds: float = 0.0) -> Sandbox:
    """The Sandbox value for runtime folder `rt`."""
    return Sandbox(
        name=name, address=f"10.233.{_index(rt)}.2", runtime_dir=rt, ssh_config=rt / "ssh_config",
        ssh_key=rt / "id_ed25519", known_hosts=rt / "known_hosts", up_seconds=up_seconds,
    )


# ---------------------------------------------------------------------------------------------
# up


def up(
    name: str = "sandbox",
    binds: Sequence[tuple[str, str]] = (),
    *,
    extra_packages: Sequence[str] = (),
    boot_timeout: float = BOOT_TIMEOUT_S,
) -> Sandbox:
    """Boot sandbox `name` from the cached rootfs and wait until systemd is running (or degraded).

    `binds` are (host path, guest path) pairs bound read-only. A name that is already up is an
    error; the remains of one that died without `down` are cleared first.
    """
    _check_name(name)
    binds = [(str(host_path), str(guest_path)) for host_path, guest_path in binds]
    for host_path, guest_path in binds:
        if ":" in host_path + guest_path or not Path(host_path).exists() or not guest_path.startswith("/"):
            raise SandboxError(
                f"bad bind {host_path!r} -> {guest_path!r}: need an existing host path and an absolute guest path, no ':'"
            )
    rootfs = build_rootfs(extra_packages)
    started = time.monotonic()
    rt = runtime_dir(name)
    with _locked(RUNTIME_ROOT / ".lock"):
        if rt.exists():
            if _owned_pid(rt, "nspawn.pid") or _owned_pid(rt, "supervisor.pid") or _alive(_read_pid(rt / "up.pid")):
                raise SandboxError(
                    f"sandbox {name!r} is already up (or coming up): `ssh -F {rt}/ssh_config sfsb-{name}`; `down` it first"
                )
            _teardown(name)  # the remains of a sandbox that died without `down`
        index = _free_index()
        rt.mkdir(parents=True)
        (rt / "index").write_text(f"{index}\n")
        (rt / "up.pid").write_text(f"{os.getpid()}\n")  # claims the name until booted
    try:
        _start(name, rt, rootfs, binds)
        state = _wait_running(name, rt, time.monotonic() + boot_timeout)
    except BaseException:
        down(name)
        raise
    (rt / "up.pid").unlink()
    seconds = time.monotonic() - started
    _say(f"{name} is up ({state}) at 10.233.{index}.2 in {seconds:.2f} s; ssh -F {rt}/ssh_config sfsb-{name}")
    return _sandbox(name, rt, seconds)


def _start(name: str, rt: Path, rootfs: Path, binds: Sequence[tuple[str, str]]) -> None:
    """Mount the overlay, give the guest its keys, make its network and cgroups, boot it."""
    layers = cache_dir() / "sandboxes" / name
    _remove_tree(layers)
    (layers / "upper").mkdir(parents=True)
    (layers / "work").mkdir()
    (rt / "layers").write_text(f"{layers}\n")
    merged = rt / "root"
    merged.mkdir()
    _run("mount the overlay", [
        "mount", "-t", "overlay", f"sfsb-{name}", "-o",
        f"lowerdir={rootfs},upperdir={layers / 'upper'},workdir={layers / 'work'}", str(merged),
    ])
    index = _index(rt)
    _personalize(name, rt, merged, f"10.233.{index}.2")
    _create_network(name, index)
    cgroups = _create_cgroups(name)
    (rt / "cgroups").write_text("".join(f"{d}\n" for d in cgroups))
    _boot(name, rt, merged, binds, cgroups)


def _personalize(name: str, rt: Path, merged: Path, address: str) -> None:
    """Write this sandbox's host key, client key, machine id and hostname, and its ssh files."""
    host_key = merged / "etc/ssh/ssh_host_ed25519_key"
    _run("make the guest's host key", [*KEYGEN, "-C", f"sfsb-{name}", "-f", str(host_key)])
    client_key = rt / "id_ed25519"
    _run("make the client key", [*KEYGEN, "-C", f"sparkform@sfsb-{name}", "-f", str(client_key)])
    authorized = merged / "root/.ssh/authorized_keys"
    authorized.parent.mkdir(mode=0o700, exist_ok=True)
    authorized.write_text(Path(f"{client_key}.pub").read_text())
    authorized.chmod(0o600)
    # A machine id of its own, so journald and D-Bus do not see every sandbox as one machine.
    (merged / "etc/machine-id").write_text(uuid.uuid4().hex + "\n")
    (merged / "etc/hostname").write_text(f"{name}\n")
    (merged / "etc/hosts").write_text(_hosts_file(name))
    key_type, key_body = Path(f"{host_key}.pub").read_text().split()[:2]
    (rt / "known_hosts").write_text(f"{address} {key_type} {key_body}\n")
    (rt / "ssh_config").write_text(
        f"Host sfsb-{name}\n"
        f"  HostName {address}\n"
        "  User root\n"
        f"  IdentityFile {client_key}\n"
        "  IdentitiesOnly yes\n"
        f"  UserKnownHostsFile {rt / 'known_hosts'}\n"
        "  GlobalKnownHostsFile /dev/null\n"
        "  StrictHostKeyChecking yes\n"
        "  BatchMode yes\n"
        "  ConnectTimeout 5\n"
        "  LogLevel ERROR\n"
        "  ControlMaster auto\n"
        f"  ControlPath {rt / 'ctl'}\n"
        "  ControlPersist 60\n"
    )


def _create_network(name: str, index: int) -> None:
    """A netns with a veth pair: host `sfsb-N` 10.233.N.1/30, guest `eth0` 10.233.N.2/30."""
    netns, host_if = netns_name(name), f"sfsb-{index}"
    _run("create the network namespace", ["ip", "netns", "add", netns])
    _run("create the veth pair", [
        "ip", "link", "add", host_if, "type", "veth", "peer", "name", GUEST_INTERFACE, "netns", netns,
    ])
    _run("address the host side", ["ip", "addr", "add", f"10.233.{index}.1/30", "dev", host_if])
    _run("bring the host side up", ["ip", "link", "set", host_if, "up"])
    # Configured from here, so the guest needs no network configuration (and no networkd).
    guest = ["ip", "-n", netns]
    _run("bring the guest's lo up", [*guest, "link", "set", "lo", "up"])
    _run("address the guest side", [*guest, "addr", "add", f"10.233.{index}.2/30", "dev", GUEST_INTERFACE])
    _run("bring the guest side up", [*guest, "link", "set", GUEST_INTERFACE, "up"])
    _run("route the guest via the host", [*guest, "route", "add", "default", "via", f"10.233.{index}.1"])


def _own_cgroups() -> list[Path]:
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
        folders.append(Path(mount[1] + "/" + path[len(mount[0].rstrip("/")):].lstrip("/")))
    return folders


def _create_cgroups(name: str) -> list[Path]:
    """Folders sfsb-NAME under our own cgroups: the container gets its own subtree everywhere
    (its cgroup namespace root), which `down` can kill and remove as a whole."""
    created = []
    for parent in _own_cgroups():
        folder = parent / f"sfsb-{name}"
        folder.mkdir(exist_ok=True)
        created.append(folder)
        # A new v1 cpuset starts empty and refuses tasks until it has CPUs and memory nodes.
        for knob in ("cpuset.cpus", "cpuset.mems"):
            if (folder / knob).exists() and not (folder / knob).read_text().strip():
                (folder / knob).write_text((parent / knob).read_text())
    return created


def _boot(name: str, rt: Path, merged: Path, binds: Sequence[tuple[str, str]], cgroups: list[Path]) -> None:
    """Start the supervisor (which runs systemd-nspawn) detached, logging to rt/nspawn.log."""
    nspawn = [
        "systemd-nspawn", "-q", "-b", "-D", str(merged), "-M", f"sfsb-{name}",
        "--register=no", "--keep-unit", "--console=pipe",
        f"--network-namespace-path={NETNS_DIR / netns_name(name)}",
        *(f"--bind-ro={host}:{guest}" for host, guest in binds),
    ]
    env = {**os.environ, "SFSB_CGROUP_PROCS": " ".join(str(d / "cgroup.procs") for d in cgroups)}
    with open(rt / "nspawn.log", "ab") as log:
        # setsid --fork: a new session, and the supervisor is re-parented to init at once, so it
        # neither dies with nor lingers as a zombie of the process that called `up`.
        subprocess.run(
            ["setsid", "--fork", "sh", "-c", SUPERVISOR_SH, "sfsb-supervisor", str(rt), *nspawn],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, check=True,
        )


def _wait_running(name: str, rt: Path, deadline: float) -> str:
    """Wait until `systemctl is-system-running --wait` over SSH says running or degraded."""
    sandbox = _sandbox(name, rt)
    last = "no answer yet"
    while time.monotonic() < deadline:
        if _read_pid(rt / "supervisor.pid") and not _owned_pid(rt, "supervisor.pid"):
            raise SandboxError(f"sandbox {name!r}: systemd-nspawn stopped while booting; {_log_tail(rt)}")
        try:
            answer = subprocess.run(
                [*sandbox.ssh_args(), "systemctl", "is-system-running", "--wait"],
                check=False, capture_output=True, text=True, timeout=max(1.0, deadline - time.monotonic()),
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
        f"sandbox {name!r} did not reach running/degraded in time (last: {last}); {_log_tail(rt)}\n"
        f"{_guest_journal(rt)}"
    )


def _pending_jobs(sandbox: Sandbox) -> str:
    """The guest's queued start jobs: what a boot that does not finish is waiting for."""
    try:
        jobs = subprocess.run(
            [*sandbox.ssh_args(), "systemctl", "list-jobs", "--no-pager", "--no-legend"],
            check=False, capture_output=True, text=True, timeout=10,
        )
    except subprocess.TimeoutExpired:
        return "`systemctl list-jobs` did not answer either"
    return f"jobs: {'; '.join(jobs.stdout.strip().splitlines()) or jobs.stderr.strip() or 'none'}"


def _guest_journal(rt: Path) -> str:
    """The end of the guest's journal, read from inside with nsenter (sshd may be what failed);
    nspawn's log rarely helps: with --console=pipe the guest has no console to print to."""
    try:
        init = _container_init(rt)
        journal = subprocess.run(
            ["nsenter", "-t", str(init), "-a", "journalctl", "-b", "-n", "40", "--no-pager", "-o", "short-monotonic"],
            check=False, capture_output=True, text=True, timeout=10,
        )
    except (SandboxError, subprocess.TimeoutExpired) as err:
        return f"(the guest's journal could not be read: {err})"
    return f"end of the guest's journal:\n{journal.stdout.strip() or journal.stderr.strip()}"


# ---------------------------------------------------------------------------------------------
# reboot, memory controller, status


def reboot(name: str, timeout: float = REBOOT_TIMEOUT_S) -> float:
    """Reboot the guest and wait until the same sandbox finished booting; returns the seconds it took.

    The supervisor boots the same overlay again (same files, keys and address). The boot ends when
    every enabled unit started, engines included. A memory controller made writable before is
    made writable again.
    """
    sandbox = get(name)
    rt = sandbox.runtime_dir
    before = _owned_pid(rt, "nspawn.pid")
    if before is None:
        raise SandboxError(f"sandbox {name!r} is not running (no live systemd-nspawn); `down` and `up` it")
    started = time.monotonic()
    deadline = started + timeout
    # The connection drops while the guest goes down, so ssh's own status means nothing here.
    subprocess.run([*sandbox.ssh_args(), "systemctl", "reboot"], check=False, capture_output=True, timeout=timeout)
    _close_master(sandbox)
    while _alive(before) or _owned_pid(rt, "nspawn.pid") in (None, before):
        if time.monotonic() > deadline or not _owned_pid(rt, "supervisor.pid"):
            raise SandboxError(f"sandbox {name!r} did not boot again after the reboot; {_log_tail(rt)}")
        time.sleep(0.05)
    _wait_running(name, rt, deadline)
    if (rt / "memory-writable").exists():
        memory_controller_writable(name)
    seconds = time.monotonic() - started
    _say(f"{name} rebooted in {seconds:.2f} s")
    return seconds


def _container_init(rt: Path) -> int:
    """The host pid of the guest's PID 1 (systemd): nspawn's child that is pid 1 in its namespace."""
    nspawn = _owned_pid(rt, "nspawn.pid")
    if nspawn is None:
        raise SandboxError(f"no live systemd-nspawn for {rt}")
    for status in Path("/proc").glob("[0-9]*/status"):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
            if fields["PPid"].strip() == str(nspawn) and fields.get("NSpid", "").split()[-1:] == ["1"]:
                return int(status.parent.name)
    raise SandboxError(f"systemd-nspawn {nspawn} has no container init process")


def memory_controller_writable(name: str) -> None:
    """Make the guest enforce MemoryMax= and friends.

    nspawn mounts the v1 memory controller read-only in the guest, so systemd stores limits but
    cannot apply them. Remount it read-write in the container's mount namespace and re-exec
    systemd so it notices. Nothing to do where the guest has the unified (v2) hierarchy. `reboot`
    repeats this (a reboot mounts it read-only again).
    """
    sandbox = get(name)
    layout = _run("read the guest's cgroup layout", [*sandbox.ssh_args(), "stat", "-fc", "%T", "/sys/fs/cgroup"], timeout=60)
    fs_type = layout.stdout.strip()
    if fs_type != "cgroup2fs":
        init = _container_init(sandbox.runtime_dir)
        _run("remount the guest's memory controller read-write", [
            "nsenter", "-t", str(init), "-m", "mount", "-o", "remount,bind,rw", "/sys/fs/cgroup/memory",
        ])
        _run("re-exec the guest's systemd", [*sandbox.ssh_args(), "systemctl", "daemon-reexec"], timeout=60)
    (sandbox.runtime_dir / "memory-writable").touch()


def status(name: str) -> dict[str, object]:
    """{name, up, address, pid (systemd-nspawn), state (systemctl is-system-running; None if unreachable)}."""
    _check_name(name)
    rt = runtime_dir(name)
    result: dict[str, object] = {"name": name, "up": False, "address": None, "pid": None, "state": None}
    if not (rt / "index").is_file():
        return result
    pid = _owned_pid(rt, "nspawn.pid")
    result.update(up=pid is not None, address=f"10.233.{_index(rt)}.2", pid=pid)
    if pid is not None and (rt / "ssh_config").is_file():
        with contextlib.suppress(subprocess.TimeoutExpired):
            answer = subprocess.run(
                [*_sandbox(name, rt).ssh_args(), "systemctl", "is-system-running"],
                check=False, capture_output=True, text=True, timeout=10,
            )
            result["state"] = answer.stdout.strip() or None
    return result


# ---------------------------------------------------------------------------------------------
# down


def down(name: str) -> None:
    """Power sandbox `name` off and remove all of it; a name that is not up is a no-op."""
    _check_name(name)
    if not runtime_dir(name).exists():
        return
    with _locked(RUNTIME_ROOT / ".lock"):
        _teardown(name)


def _teardown(name: str) -> None:
    """Stop everything of sandbox `name` and delete it, whatever state it is in (caller holds the lock)."""
    rt = runtime_dir(name)
    started = time.monotonic()
    (rt / "stopping").touch()  # tells the supervisor not to boot again
    if (rt / "ssh_config").is_file():
        _close_master(_sandbox(name, rt))
    _power_off(rt)
    cgroups = [Path(line) for line in _read_lines(rt / "cgroups")]
    _kill_all(rt, cgroups)
    nspawn_files = _nspawn_files(name, rt)
    _unmount_all(rt)
    layers = [Path(line) for line in _read_lines(rt / "layers")]
    for folder in layers:
        _unmount_all(folder)
    if (NETNS_DIR / netns_name(name)).exists():
        _run("delete the network namespace", ["ip", "netns", "del", netns_name(name)])
    for folder in cgroups:
        _remove_cgroup(folder)
    for path in nspawn_files:
        _remove_tree(path)
    for folder in layers:
        _remove_tree(folder)
    _remove_tree(rt)
    _say(f"{name} is down ({time.monotonic() - started:.2f} s)")


def _nspawn_files(name: str, rt: Path) -> list[Path]:
    """What systemd-nspawn leaves in /run/systemd/nspawn when it cannot clean up (it was killed,
    or, on a /run that is not tmpfs, after a reboot): its propagation folder and image lock."""
    files = [NSPAWN_RUN / "propagate" / f"sfsb-{name}"]
    if (rt / "root") in _mounts_under(rt / "root"):
        root = os.stat(rt / "root")
        files.append(NSPAWN_RUN / "locks" / f"inode-{root.st_dev}:{root.st_ino}")
    return files


def _read_lines(path: Path) -> list[str]:
    """Non-empty lines of a file ([] when missing)."""
    try:
        return [line for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def _close_master(sandbox: Sandbox) -> None:
    """Stop the SSH control master, if one runs (else it would outlive the sandbox)."""
    if (sandbox.runtime_dir / "ctl").exists():
        subprocess.run([*sandbox.ssh_args(), "-O", "exit"], check=False, capture_output=True, timeout=10)


def _power_off(rt: Path) -> None:
    """SIGTERM systemd-nspawn (the guest powers off cleanly) and wait a bounded time for it."""
    nspawn = _owned_pid(rt, "nspawn.pid")
    if nspawn is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(nspawn, signal.SIGTERM)
    deadline = time.monotonic() + POWEROFF_TIMEOUT_S
    while _alive(nspawn) and time.monotonic() < deadline:
        time.sleep(0.05)


def _cgroup_pids(folder: Path) -> set[int]:
    """Every process in cgroup `folder` and below."""
    pids: set[int] = set()
    for here, _dirs, _files in os.walk(folder):
        with contextlib.suppress(FileNotFoundError):
            pids |= {int(p) for p in Path(here, "cgroup.procs").read_text().split()}
    return pids


def _kill_all(rt: Path, cgroups: list[Path]) -> None:
    """SIGKILL whatever of the sandbox still runs: its cgroups' processes and its own pids."""
    for folder in cgroups:
        if (folder / "cgroup.kill").exists():
            (folder / "cgroup.kill").write_text("1")
    deadline = time.monotonic() + KILL_TIMEOUT_S
    while True:
        left = {pid for folder in cgroups if folder.exists() for pid in _cgroup_pids(folder)}
        left |= {pid for pid in (_owned_pid(rt, "supervisor.pid"), _owned_pid(rt, "nspawn.pid")) if pid}
        left = {pid for pid in left if _alive(pid)}
        if not left:
            return
        if time.monotonic() > deadline:
            raise SandboxError(f"processes of {rt.name!r} survive SIGKILL: {sorted(left)}")
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _remove_cgroup(folder: Path) -> None:
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


# ---------------------------------------------------------------------------------------------
# manual use: python -m sparkform.sandbox.host up|down|status|ssh|reboot|names|build NAME


def _main(argv: Sequence[str]) -> int:
    """A small CLI for trying the sandbox by hand."""
    parser = argparse.ArgumentParser(prog="python -m sparkform.sandbox.host")
    parser.add_argument("action", choices=["build", "up", "down", "status", "ssh", "reboot", "names", "memory"])
    parser.add_argument("name", nargs="?", default="sandbox")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="for ssh: the remote command")
    parser.add_argument("--bind-ro", action="append", default=[], metavar="HOST:GUEST")
    args = parser.parse_args(argv)
    try:
        if args.action == "build":
            print(build_rootfs())
        elif args.action == "up":
            print(json.dumps({"ssh": up(args.name, [tuple(b.split(":", 1)) for b in args.bind_ro]).ssh_args()}))
        elif args.action == "down":
            down(args.name)
        elif args.action == "status":
            print(json.dumps(status(args.name), indent=2))
        elif args.action == "reboot":
            reboot(args.name)
        elif args.action == "memory":
            memory_controller_writable(args.name)
        elif args.action == "names":
            print("\n".join(names()))
        else:
            os.execvp("ssh", [*get(args.name).ssh_args(), *args.command])
    except SandboxError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
