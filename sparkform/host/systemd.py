"""systemctl and the journal as sparkform's host programs call them."""

import re
import subprocess

# Why a start failed, as the deploy and the rollback show it: the journal lines since the start
# that match FAILURE_REASON_PATTERN, each cut at WHY_LINE_CHARS, the last JOURNAL_LINES of them.
JOURNAL_LINES = 30
WHY_LINE_CHARS = 400  # vLLM's unsupported-architecture line lists every architecture it knows
# Journal lines that say why a start failed: exceptions and pydantic's reasons, refusals, the
# verdicts of sparkform's scripts ("sparkform-NAME: "; a bare "sparkform-" matches every line that
# names a sparkform-test checkpoint) and of systemd.
FAILURE_REASON_PATTERN = (
    r"(Error|error:|Value error|not supported|exceeds|refus|sparkform-[a-z-]+: |Failed with result"
    r"|start request repeated)"
)


def systemctl(*args, check=False):
    return subprocess.run(["systemctl", *args], capture_output=True, text=True, timeout=120, check=check)


def started_afresh(unit):
    """`unit` started without waiting for it, out of a failed state first (a spent start limit
    refuses every start until then): the exit code of `systemctl start`."""
    systemctl("reset-failed", unit)
    return systemctl("start", "--no-block", unit).returncode


def doubled_pause(first_s, failures, most_s):
    """A back-off: first_s after the first failure, doubled for each one after it, up to most_s."""
    return min(first_s * 2 ** (failures - 1), most_s)


def run_later(unit, delay_s, description, command, collect=False):
    """`command` run once, delay_s from now, by a transient timer and service named `unit`
    (systemd-run; with collect, the unit goes once it ran, failed or not); whether it was
    scheduled."""
    try:
        return (
            subprocess.run(
                [
                    "systemd-run",
                    f"--unit={unit}",
                    *(["--collect"] if collect else []),
                    f"--on-active={delay_s}s",
                    "--timer-property=AccuracySec=1s",
                    f"--description={description}",
                    *command,
                ],
                capture_output=True,
                timeout=60,
                check=False,
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


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


def why_a_start_failed(unit, since):
    """The unit's journal lines since `since` (seconds since the epoch) that say why its start
    failed, by the rule above (the deploy applies the same rule with grep)."""
    shown = subprocess.run(
        ["journalctl", "-u", unit, "--since", f"@{int(since)}", "--no-pager", "-o", "cat"],
        capture_output=True,
        text=True,
        errors="replace",
        timeout=60,
    ).stdout
    reason = re.compile(FAILURE_REASON_PATTERN)
    return [line[:WHY_LINE_CHARS] for line in shown.splitlines() if reason.search(line)][-JOURNAL_LINES:]
