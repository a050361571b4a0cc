"""What the guard reads about a unit's processes, from the cgroup tree and /proc: which processes
it has, whether one is stopped (SIGSTOP, a debugger), how much CPU time they used, and whose
socket listens on a port. Every value comes from the kernel; the texts an engine can shape (a
process name, its command line) are only quoted, bounded, in messages."""

import os
import re
import subprocess

from sparkform.host.systemd import systemctl

CGROUP_PATTERN = re.compile(r"/[A-Za-z0-9_.@:\\/-]{0,300}")
# One listener as `ss -Hltne --cgroup` prints it: its address, uid, inode and the cgroup it was made in.
# (Root's sockets have no uid field.)
LISTENER = re.compile(r"\S+\s+\d+\s+\d+\s+\S+\s+\S+\s+(uid:(?P<uid>\d+)\s)?.*?cgroup:(?P<cgroup>/\S*)")
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


def listeners(port):
    """[(uid, cgroup)] of the TCP sockets listening on `port`, any address (sock_diag: the
    kernel's own record of the cgroup that made each socket, so no process's files are read)."""
    try:
        result = subprocess.run(
            ["ss", "-Hltne", "--cgroup", f"sport = :{int(port)}"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return []
    return parse_listeners(result.stdout)


def parse_listeners(text):
    """[(uid, cgroup)] of `ss -Hltne --cgroup`'s lines; a line of another shape is left out."""
    found = []
    for line in text.splitlines():
        match = LISTENER.match(line)
        if match and CGROUP_PATTERN.fullmatch(match["cgroup"]) and ".." not in match["cgroup"].split("/"):
            found.append((int(match["uid"] or 0), match["cgroup"]))
    return found


def strangers(port, cgroup):
    """Who listens on `port` from outside the unit's `cgroup`: one line each (uid, cgroup and its
    processes), empty when only the unit (or nobody) does."""
    lines = []
    for uid, owner in listeners(port):
        if owner == cgroup or owner.startswith(cgroup.rstrip("/") + "/"):
            continue
        # The socket owner's own processes first (a login session holds its shell and sshd too).
        pids = cgroup_pids(owner)
        pids = ([p for p in pids if uid_of(p) == uid] or pids)[:3]
        lines.append(f"uid {uid} in {owner}: " + (", ".join(describe(p) for p in pids) or "no process left"))
    return lines
