"""The sandbox's Debian rootfs: debootstrapped once per package list into a cache, then baked for
life as a container reached over SSH. Every machine boots it as the read-only lower layer of an
overlay of its own.

Also here: the cache folder (rootfs builds, wheelhouses, overlay layers), the rootfs's cache key,
and reading this machine's apt sources (one-line and deb822) for the Debian mirror debootstrap
downloads from.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from sparkform.sandbox.system import SandboxError, locked, remove_tree, run_step, say, tail

SUITE = "bookworm"
BASE_PACKAGES = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "libpam-systemd",
    "openssh-server",
    "python3",
    "python3-venv",
    "curl",
    "iproute2",
    "sudo",
    "util-linux",
    "gawk",
    "procps",
    "ca-certificates",
)
# Bump when the rootfs recipe (packages aside) changes, so old caches are not reused.
ROOTFS_FORMAT = 2
# Units a baked package enables on install that a host runs only once its inventory asks (the
# deploy enables them then): disabled in the rootfs, so a sandbox boots as such a host.
DISABLED_UNITS = ("prometheus-node-exporter.service",)
DEFAULT_CACHE = Path("/var/cache/sparkform-sandbox")
# Units that are useless in a container or slow its boot; masked in the rootfs.
MASKED_UNITS = (
    "console-getty.service",
    "container-getty@.service",
    "getty@.service",
    "serial-getty@.service",
    "getty.target",
    "systemd-networkd-wait-online.service",
    "ifupdown-wait-online.service",
    "apt-daily.timer",
    "apt-daily-upgrade.timer",
    "dpkg-db-backup.timer",
    "e2scrub_all.timer",
    "e2scrub_reap.service",
    "fstrim.timer",
    "man-db.timer",
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


def cache_dir() -> Path:
    """Where rootfs builds and overlay layers live ($SPARKFORM_SANDBOX_CACHE or /var/cache/...)."""
    return Path(os.environ.get("SPARKFORM_SANDBOX_CACHE") or DEFAULT_CACHE)


def hosts_file(hostname: str) -> str:
    """An /etc/hosts that resolves `hostname` (sudo complains otherwise)."""
    return f"127.0.0.1 localhost\n127.0.1.1 {hostname}\n::1 localhost ip6-localhost ip6-loopback\n"


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
    with locked(cache / f".rootfs-{key}.lock") as lock_fd:
        if rootfs.is_dir():  # another process finished it while we waited for the lock
            return rootfs
        # Holding the lock, any build folder left here belongs to a build that died (debootstrap
        # inherits the lock, so one that outlived its parent still holds it).
        building = cache / f".building-rootfs-{key}"
        remove_tree(building)
        mirror = apt_mirror()
        log = cache / f".building-rootfs-{key}.log"
        say(f"building the rootfs with debootstrap ({SUITE}, {mirror}); this takes 1-2 min; log: {log}")
        started = time.monotonic()
        _debootstrap(building, packages, mirror, log, lock_fd)
        _bake(building)
        building.rename(rootfs)
        log.unlink(missing_ok=True)
        say(f"rootfs ready in {time.monotonic() - started:.0f} s: {rootfs}")
    return rootfs


def _debootstrap(target: Path, packages: Sequence[str], mirror: str, log: Path, lock_fd: int) -> None:
    """debootstrap a minbase `SUITE` with `packages` into `target` (output to `log`), holding
    the build lock `lock_fd` for as long as debootstrap runs."""
    cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(packages)}", SUITE, str(target), mirror]
    target.mkdir(parents=True)
    try:
        with open(log, "w") as out:
            code = subprocess.run(
                cmd, check=False, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, pass_fds=[lock_fd]
            ).returncode
    except FileNotFoundError:
        raise SandboxError("build rootfs: `debootstrap` is not installed (apt-get install debootstrap)") from None
    if code != 0:
        raise SandboxError(f"build rootfs failed: `{shlex.join(cmd)}` exited {code}; end of {log}:\n{tail(log)}")


def _bake(root: Path) -> None:
    """Configure a fresh rootfs for life as a container reached over SSH."""
    run_step("enable ssh in the rootfs", ["systemctl", f"--root={root}", "enable", "ssh.service"])
    for unit in DISABLED_UNITS:
        if any((root / folder / unit).exists() for folder in ("lib/systemd/system", "etc/systemd/system")):
            run_step(f"disable {unit} in the rootfs", ["systemctl", f"--root={root}", "disable", unit])
    for unit in MASKED_UNITS:
        link = root / "etc/systemd/system" / unit
        link.unlink(missing_ok=True)
        link.symlink_to("/dev/null")
    (root / "etc/ssh/sshd_config.d/sparkform-sandbox.conf").write_text(SSHD_CONFIG)
    for host_key in (root / "etc/ssh").glob("ssh_host_*"):  # each sandbox gets its own
        host_key.unlink()
    (root / "etc/hostname").write_text("sandbox\n")
    (root / "etc/hosts").write_text(hosts_file("sandbox"))
    (root / "root/.ssh").mkdir(mode=0o700, exist_ok=True)
    for deb in (root / "var/cache/apt/archives").glob("*.deb"):
        deb.unlink()
