"""systemctl as sparkform's host programs call it."""

import subprocess


def systemctl(*args, check=False):
    return subprocess.run(["systemctl", *args], capture_output=True, text=True, timeout=120, check=check)


def active_state(unit):
    return systemctl("show", "-p", "ActiveState", "--value", unit).stdout.strip()
