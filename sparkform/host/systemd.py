"""systemctl and the journal as sparkform's host programs call them."""

import subprocess


def systemctl(*args, check=False):
    return subprocess.run(["systemctl", *args], capture_output=True, text=True, timeout=120, check=check)


def active_state(unit):
    return systemctl("show", "-p", "ActiveState", "--value", unit).stdout.strip()


def unit_state(unit):
    """(ActiveState, SubState): ("activating", "start-post") while the readiness helper runs,
    ("activating", "auto-restart") while systemd waits to start it again."""
    shown = dict(
        line.partition("=")[::2] for line in systemctl("show", "-p", "ActiveState,SubState", unit).stdout.splitlines()
    )
    return shown.get("ActiveState", ""), shown.get("SubState", "")


def job_types(unit):
    """The types of the jobs queued for the unit (stop, restart, start, ...)."""
    listed = systemctl("list-jobs", "--no-legend", "--plain", unit).stdout.splitlines()
    return [line.split()[2] for line in listed if len(line.split()) >= 3]


def invocation_journal(unit, invocation, limit_bytes, line_chars):
    """One start's journal lines (the engine's own output among them): at most `limit_bytes`,
    each cut at `line_chars`."""
    with subprocess.Popen(
        ["journalctl", "--no-pager", "-o", "cat", f"_SYSTEMD_UNIT={unit}", f"_SYSTEMD_INVOCATION_ID={invocation}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    ) as reader:
        data = reader.stdout.read(limit_bytes)
        reader.kill()
    return [line[:line_chars] for line in data.decode("utf-8", "replace").splitlines()]


def journal_cursor(unit):
    """The cursor of the unit's latest journal entry ("" when none): it moves with every new line."""
    shown = subprocess.run(
        ["journalctl", "--no-pager", "-q", "-n", "1", "--show-cursor", "-o", "cat", "-u", unit],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    return shown.rpartition("-- cursor: ")[2].strip()
