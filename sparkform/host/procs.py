"""What the guard reads about a unit's processes, from the cgroup tree and /proc: which processes
it has, whether one is stopped (SIGSTOP, a debugger), how much CPU time they used, and which
process listens on an engine's unix socket. Every value comes from the kernel; the texts an
engine can shape (a process name, its command line) are only quoted, bounded, in messages."""

import os
import re
import socket
import struct

from sparkform.host.systemd import systemctl

CGROUP_PATTERN = re.compile(r"/[A-Za-z0-9_.@:\\/-]{0,300}")
SHOWN_CHARS = 200


def cgroup2_root(mountinfo="/proc/self/mountinfo"):
    """Where the cgroup v2 tree is mounted: /sys/fs/cgroup, or /sys/fs/cgroup/unified on a
    hybrid host (systemd's own tree there; the controllers in v1)."""
    try:
        with open(mountinfo) as handle:
            for line in handle:
                before, _, after = line.partition(" - ")
                if after.split(" ", 1)[0] == "cgroup2":
                    return before.split()[4]
    except OSError:
        pass
    return "/sys/fs/cgroup"


def unit_cgroup(unit):
    """The unit's cgroup path as systemd names it ("" when it has none: not running)."""
    path = systemctl("show", "-p", "ControlGroup", "--value", unit).stdout.strip()
    return path if CGROUP_PATTERN.fullmatch(path) and ".." not in path.split("/") else ""


def cgroup_pids(cgroup, root=None):
    """Every process in the cgroup and the cgroups below it."""
    pids = []
    for folder, _, files in os.walk(os.path.join(root or cgroup2_root(), cgroup.lstrip("/"))):
        if "cgroup.procs" in files:
            try:
                with open(os.path.join(folder, "cgroup.procs")) as handle:
                    pids += [int(line) for line in handle if line.strip().isdigit()]
            except OSError:
                continue  # the cgroup went away meanwhile
    return pids


def cpu_seconds(cgroup, root=None):
    """CPU time the cgroup's processes used, in seconds (cgroup v2's cpu.stat); None: unreadable."""
    try:
        with open(os.path.join(root or cgroup2_root(), cgroup.lstrip("/"), "cpu.stat")) as handle:
            for line in handle:
                key, _, value = line.partition(" ")
                if key == "usage_usec" and value.strip().isdigit():
                    return int(value) / 1e6
    except OSError:
        pass
    return None


def process_state(pid, proc="/proc"):
    """The one-letter state of /proc/PID/stat (R, S, D, T stopped, t traced, ...); "" when gone."""
    try:
        with open(f"{proc}/{pid}/stat") as handle:
            stat = handle.read()
    except OSError:
        return ""
    # The name in parentheses may hold anything, ")" too: the state follows the last ")".
    fields = stat.rpartition(")")[2].split()
    return fields[0] if fields else ""


def uid_of(pid, proc="/proc"):
    """The real uid of /proc/PID/status (None when gone)."""
    try:
        with open(f"{proc}/{pid}/status") as handle:
            for line in handle:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def stopped_pids(pids, proc="/proc"):
    return [pid for pid in pids if process_state(pid, proc) in ("T", "t")]


def shown(text):
    """A process's own text, safe in one journal line: printable, bounded."""
    text = "".join(c if c.isprintable() else " " for c in text).strip()
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def describe(pid, proc="/proc"):
    """ "PID (command line)" for a message."""
    try:
        with open(f"{proc}/{pid}/cmdline", "rb") as handle:
            words = handle.read(4096).split(b"\0")
    except OSError:
        return f"{pid}"
    return f"{pid} ({shown(' '.join(w.decode('utf-8', 'replace') for w in words if w))})"


def listener(path, timeout_s=2.0):
    """(pid, uid) of the process that listens on the unix socket `path`, as the kernel recorded
    them when it called listen() (SO_PEERCRED); None when nothing listens there."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(timeout_s)
        try:
            client.connect(path)
            pid, uid, _ = struct.unpack("3i", client.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        except OSError:
            return None
    return pid, uid


def strangers(path, cgroup, proc="/proc"):
    """Who listens on the unix socket `path` from outside the unit's `cgroup`: one line (uid and
    process), or none when the unit (or nobody) does."""
    found = listener(path)
    if found is None or found[0] in cgroup_pids(cgroup):
        return []
    pid, uid = found
    return [f"uid {uid}: {describe(pid, proc)}"]
