"""The container's processes: systemd-nspawn under a small shell supervisor, the guest's PID 1,
and stopping them.

systemd-nspawn exits with status 133 when the guest reboots; the supervisor runs it in a loop and
boots the same overlay again on 133 (any other status ends the sandbox). So a reboot from inside
(`systemctl reboot`, pyinfra's server.reboot) also brings the machine back. Both write their pids
into the runtime folder (supervisor.pid, nspawn.pid) and log to its nspawn.log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from sparkform.sandbox.cgroups import KILL_TIMEOUT_S, cgroup_pids, kill_cgroup
from sparkform.sandbox.network import netns_path
from sparkform.sandbox.registry import PREFIX, owned_pid, system_name
from sparkform.sandbox.system import SandboxError, alive, mounts_under, tail

NSPAWN_RUN = Path("/run/systemd/nspawn")
POWEROFF_TIMEOUT_S = 15.0
# Runs systemd-nspawn ("$@") and boots it again when the guest rebooted (exit status 133),
# unless `down` is under way. It moves itself into the sandbox's cgroup folders first, so the
# container and everything it starts live there.
SUPERVISOR_SH = """\
runtime_dir=$1; shift
echo $$ > "$runtime_dir/supervisor.pid"
for procs in $SFSB_CGROUP_PROCS; do echo $$ > "$procs" || exit 1; done
while :; do
  "$@" &
  echo $! > "$runtime_dir/nspawn.pid"
  wait $!
  rc=$?
  if [ "$rc" -ne 133 ] || [ -e "$runtime_dir/stopping" ]; then
    echo "$0: systemd-nspawn exited $rc"
    exit "$rc"
  fi
  echo "$0: the guest rebooted; booting it again"
done
"""


def start(name: str, runtime_dir: Path, root: Path, binds: Sequence[tuple[str, str]], cgroups: list[Path]) -> None:
    """Start the supervisor (which runs systemd-nspawn on `root`) detached, logging to nspawn.log."""
    nspawn = [
        # systemd-nspawn mounts the guest's /sys before it joins --network-namespace-path, and a
        # sysfs shows the interfaces of the namespace it was mounted in: started in the sandbox's
        # namespace already, the guest's /sys/class/net lists its own interfaces (eth0, cx7), as
        # on a host, not this machine's.
        "nsenter",
        f"--net={netns_path(name)}",
        "systemd-nspawn",
        "-q",
        "-b",
        "-D",
        str(root),
        "-M",
        system_name(name),
        "--register=no",
        "--keep-unit",
        "--console=pipe",
        f"--network-namespace-path={netns_path(name)}",
        # As a host's systemd may: set up the loopback of a unit's own network (PrivateNetwork=, the
        # engines'); the guest's network namespace is its own, this machine's stays out of reach.
        "--capability=CAP_NET_ADMIN",
        *(f"--bind-ro={host}:{guest}" for host, guest in binds),
    ]
    env = {**os.environ, "SFSB_CGROUP_PROCS": " ".join(str(d / "cgroup.procs") for d in cgroups)}
    with open(runtime_dir / "nspawn.log", "ab") as log:
        # setsid --fork: a new session, and the supervisor is re-parented to init at once, so it
        # neither dies with nor lingers as a zombie of the process that called `up`.
        subprocess.run(
            ["setsid", "--fork", "sh", "-c", SUPERVISOR_SH, f"{PREFIX}supervisor", str(runtime_dir), *nspawn],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            check=True,
        )


def log_tail(runtime_dir: Path) -> str:
    """'end of NSPAWN LOG:' and its last lines, for error messages."""
    return f"end of {runtime_dir / 'nspawn.log'}:\n{tail(runtime_dir / 'nspawn.log')}"


def container_init(runtime_dir: Path) -> int:
    """The host pid of the guest's PID 1 (systemd): nspawn's child that is pid 1 in its namespace."""
    nspawn = owned_pid(runtime_dir, "nspawn.pid")
    if nspawn is None:
        raise SandboxError(f"no live systemd-nspawn for {runtime_dir}")
    for status in Path("/proc").glob("[0-9]*/status"):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
            if fields["PPid"].strip() == str(nspawn) and fields.get("NSpid", "").split()[-1:] == ["1"]:
                return int(status.parent.name)
    raise SandboxError(f"systemd-nspawn {nspawn} has no container init process")


def guest_journal(runtime_dir: Path) -> str:
    """The end of the guest's journal, read from inside with nsenter (sshd may be what failed);
    nspawn's log rarely helps: with --console=pipe the guest has no console to print to."""
    try:
        init = container_init(runtime_dir)
        journal = subprocess.run(
            ["nsenter", "-t", str(init), "-a", "journalctl", "-b", "-n", "40", "--no-pager", "-o", "short-monotonic"],
            check=False,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (SandboxError, subprocess.TimeoutExpired) as err:
        return f"(the guest's journal could not be read: {err})"
    return f"end of the guest's journal:\n{journal.stdout.strip() or journal.stderr.strip()}"


def power_off(runtime_dir: Path) -> None:
    """SIGTERM systemd-nspawn (the guest powers off cleanly) and wait a bounded time for it."""
    nspawn = owned_pid(runtime_dir, "nspawn.pid")
    if nspawn is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(nspawn, signal.SIGTERM)
    deadline = time.monotonic() + POWEROFF_TIMEOUT_S
    while alive(nspawn) and time.monotonic() < deadline:
        time.sleep(0.05)


def kill_all(runtime_dir: Path, cgroups: list[Path]) -> None:
    """SIGKILL whatever of the sandbox still runs: its cgroups' processes and its own pids."""
    for folder in cgroups:
        kill_cgroup(folder)
    deadline = time.monotonic() + KILL_TIMEOUT_S
    while True:
        left = {pid for folder in cgroups if folder.exists() for pid in cgroup_pids(folder)}
        own = (owned_pid(runtime_dir, "supervisor.pid"), owned_pid(runtime_dir, "nspawn.pid"))
        left |= {pid for pid in own if pid}
        left = {pid for pid in left if alive(pid)}
        if not left:
            return
        if time.monotonic() > deadline:
            raise SandboxError(f"processes of {runtime_dir.name!r} survive SIGKILL: {sorted(left)}")
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def leftover_files(name: str, runtime_dir: Path) -> list[Path]:
    """What systemd-nspawn leaves in /run/systemd/nspawn when it cannot clean up (it was killed,
    or, on a /run that is not tmpfs, after a reboot): its propagation folder and image lock."""
    files = [NSPAWN_RUN / "propagate" / system_name(name)]
    if (runtime_dir / "root") in mounts_under(runtime_dir / "root"):
        root = os.stat(runtime_dir / "root")
        files.append(NSPAWN_RUN / "locks" / f"inode-{root.st_dev}:{root.st_ino}")
    return files
