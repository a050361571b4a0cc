"""Every unplanned stop reaches a human, once per outage: an engine that exits or is killed
without a stop anyone asked for, a start that failed, the host back from a reboot. The outage
opens with one alert (what, when, why as far as the journal says) and closes with one "serves
again after N s" once the engine served again (guard `served`). Stops inside an outage already
told (a crash loop) are journaled only, and a stop the guard made itself (a hang, a stalled
start) was alerted by it."""

import os
import re
import shutil
import time

from sparkform.host import GuardEngine, GuardSettings
from sparkform.host.alerts import alert, journal, read_json, write_json
from sparkform.host.kvlog import JOURNAL_BYTES, LINE_CHARS
from sparkform.host.procs import shown, strangers, unit_cgroup
from sparkform.host.systemd import invocation_journal, job_types

PLANNED_JOBS = ("stop", "restart", "try-restart", "reload-or-restart")
GUARD_KILL_S = 120  # a guard's kill marker older than this is not the reason of this stop
# The engine's last words worth quoting: sparkform's own helpers, errors, OOM, CUDA; not the
# launch's "starting" line nor the helper's "died" line, which say nothing of why.
LAST_WORDS = re.compile(r"sparkform-(launch|wait-ready): |Error|error:|CUDA|Killed|Traceback|out of memory")
NOT_WHY = re.compile(
    r"sparkform-launch: starting |sparkform-wait-ready: engine main process \d+ died after|^sparkform-guard: "
    r"|HTTP/\d(\.\d)?\" \d{3}"
)  # the guard's: its own report of an earlier stop; the last: an access log line ("POST /v1/completions HTTP/1.1" 500)
RESULTS = {
    "oom-kill": "the kernel's OOM killer ended it (MemoryMax, or the box out of memory)",
    "timeout": "it took longer than TimeoutStartSec",
    "core-dump": "it dumped core",
    "start-limit-hit": "it spent its start limit",
}


def outage_path(config: GuardSettings, name):
    return os.path.join(config["state_dir"], f"outage-{name}.json")


def spare_outage_path(config: GuardSettings, name):
    return os.path.join(config["outage_spare_dir"], f"outage-{name}.json")


def open_outage(config: GuardSettings, name, outage, what):
    """Record an engine's outage in the state folder, or where that takes no write (full,
    read-only) in the spare folder on tmpfs; journaled if neither can keep it."""
    try:
        write_json(outage_path(config, name), outage)
        return
    except OSError as err:
        failed = err
    try:
        os.makedirs(config["outage_spare_dir"], mode=0o700, exist_ok=True)
        write_json(spare_outage_path(config, name), outage)
    except OSError:
        journal(config, f"sparkform-guard: {what} is not recorded: {failed}", 3)
    else:
        journal(config, f"sparkform-guard: {what} is kept in {config['outage_spare_dir']}: {failed}", 4)


def read_outage(config: GuardSettings, name):
    """The engine's open outage (None: none), from the state folder or the spare one."""
    outage = read_json(outage_path(config, name), None)
    return outage if outage is not None else read_json(spare_outage_path(config, name), None)


def close_outage(config: GuardSettings, name):
    for path in (outage_path(config, name), spare_outage_path(config, name)):
        if os.path.exists(path):
            os.unlink(path)


def recorded(config: GuardSettings, path, value, what):
    """write_json; a failure (a full or read-only state folder) is journaled, not raised: the alert
    that goes with the record is still sent, and only `what` is lost."""
    try:
        write_json(path, value)
    except OSError as err:
        journal(config, f"sparkform-guard: {what} is not recorded: {err}", 3)


def kill_marker(config: GuardSettings, name):
    return os.path.join(config["state_dir"], f"guard-kill-{name}.json")


def guard_kills(config: GuardSettings, name, why):
    """Before the guard kills a unit: its stop is the guard's, alerted by the guard."""
    recorded(config, kill_marker(config, name), {"time": time.time(), "why": why}, f"that the guard stopped {name}")


def outage_since(outage):
    """When the outage began (None: no number there)."""
    since = outage.get("since") if isinstance(outage, dict) else None
    return since if isinstance(since, (int, float)) and not isinstance(since, bool) else None


def clock(at):
    return time.strftime("%H:%M:%S UTC", time.gmtime(at))


def why_stopped(result, code, status, lines):
    """The reason in systemd's words (SERVICE_RESULT, EXIT_CODE, EXIT_STATUS), with the last
    line of the start's journal that names an error."""
    if result in RESULTS:
        reason = RESULTS[result]
    elif code == "exited":
        reason = f"exit code {status}" + (" (a fatal engine error can end in exit 0)" if status == "0" else "")
    elif code in ("killed", "dumped"):
        reason = f"signal SIG{status}"
    else:
        reason = f"{result or 'unknown'}"
    words = last_error_line(lines)
    return reason + (f"; its last error line: {words}" if words else "")


def last_error_line(lines):
    """The last line of a start's journal that names an error, as an alert shows it ("" if none)."""
    words = [line for line in lines if LAST_WORDS.search(line) and not NOT_WHY.search(line)]
    return shown(words[-1]) if words else ""


def cmd_stopped(config: GuardSettings, engine: GuardEngine, tell, environ=os.environ):
    """ExecStopPost= of an engine, as root: every stop of the unit passes here. `tell(event,
    message)` sends the alert (from outside the engine's cgroup)."""
    if any(job in PLANNED_JOBS for job in job_types(engine["unit"])):
        return  # a stop or restart someone asked for (a deploy, an owner, a shutdown)
    now, name = time.time(), engine["name"]
    invocation = environ.get("INVOCATION_ID", "")
    lines = invocation_journal(engine["unit"], invocation, JOURNAL_BYTES, LINE_CHARS) if invocation else []
    cgroup = unit_cgroup(engine["unit"])  # ExecStopPost= still runs in it
    held = strangers(engine["socket"], cgroup) if cgroup else []
    why = why_stopped(
        environ.get("SERVICE_RESULT", ""), environ.get("EXIT_CODE", ""), environ.get("EXIT_STATUS", ""), lines
    )
    if held:
        why += f"; its socket {engine['socket']} is held by {'; '.join(held)}"
    marker = read_json(kill_marker(config, name), None)
    if marker is not None:
        os.unlink(kill_marker(config, name))
    by_guard = marker is not None and isinstance(marker.get("time"), float) and now - marker["time"] < GUARD_KILL_S
    outage = read_outage(config, name)
    if outage is not None:
        journal(
            config,
            f"sparkform-guard: {engine['unit']} stopped again, still dark since "
            f"{clock(outage_since(outage) or now)}: {why}",
            4,
        )
        return
    short = (marker["why"] if by_guard else why).split("; ")[0]  # the alert has the rest
    open_outage(config, name, {"since": now, "why": short}, f"the outage of {engine['unit']}")
    if not by_guard:
        tell(
            "stopped",
            f"{engine['unit']} stopped at {clock(now)} without a stop anyone asked for: {why}; "
            f"systemd starts it again in {config['restart_s']} s",
        )


def served_again(config: GuardSettings, engine: GuardEngine, failed_limits):
    """After a start that served: close the engine's outage with one alert, if one was open."""
    outage = read_outage(config, engine["name"])
    if outage is None and not failed_limits:
        return None
    if outage is not None:
        close_outage(config, engine["name"])
    since = outage_since(outage)
    parts = [f"{engine['unit']} serves again"]
    if since is not None:
        parts.append(f"after {time.time() - since:.0f} s dark (since {clock(since)}: {outage.get('why', '?')})")
    if failed_limits:
        parts.append(f"after {failed_limits} failed start limit(s)")
    return " ".join(parts)


# --- the host's boots and the guard's own life ------------------------------------------------------


def boot_id(path="/proc/sys/kernel/random/boot_id"):
    with open(path) as handle:
        return handle.read().strip()


def pid1_start(path="/proc/1/stat"):
    """When PID 1 started, in clock ticks since the kernel booted (stat's 22nd field): a boot of
    its own where the kernel's boot ID outlives one (a container's reboot: the guard's
    ProtectKernelTunables= view shows the host kernel's ID). None when unreadable."""
    try:
        with open(path) as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def alive_path(config: GuardSettings):
    return os.path.join(config["state_dir"], "guard-alive.json")


def alive(config: GuardSettings, clean=False, why=None):
    """The guard's heartbeat: this boot, now, whether it stops cleanly (SIGTERM) and, from a guard
    that exits on a failure of its own, why."""
    beat = {"boot": boot_id(), "pid1": pid1_start(), "time": time.time(), "clean": clean}
    write_json(alive_path(config), {**beat, "why": why} if why else beat)


def heartbeat(config: GuardSettings, failing, clean=False, why=None):
    """Write the heartbeat; whether that fails now. A failure (a full or read-only state folder) is
    alerted once (`disk-full`, with the error and the folder's free bytes) and the guard watches on
    from memory; the first write that works again is alerted too (`disk-recovered`)."""
    folder = config["state_dir"]
    try:
        alive(config, clean, why)
    except OSError as err:
        if not failing:
            alert(
                config,
                "disk-full",
                "-",
                f"the guard cannot write in {folder} ({err.strerror or err}; {free_bytes(folder)} bytes free there): "
                "it watches on, but keeps no heartbeat, outage record or kept alert until it can; free space there",
            )
        return True
    if failing:
        alert(config, "disk-recovered", "-", f"the guard writes in {folder} again")
    return False


def free_bytes(folder):
    """The bytes free to root under `folder`, or "?" where that cannot be read."""
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return "?"


def booted_since(last):
    """Whether the host booted since the heartbeat `last` (one written before PID 1's start was
    kept: by the kernel's boot ID alone)."""
    return last.get("boot") != boot_id() or ("pid1" in last and last["pid1"] != pid1_start())


def after_start(config: GuardSettings):
    """At the daemon's start: a reboot since the last heartbeat, or a guard that died without a
    clean stop, is alerted; after a reboot each engine's outage opens, to close with its
    "serves again"."""
    last = read_json(alive_path(config), None)
    if last is None or not isinstance(last.get("time"), float):
        return
    seen, clean = clock(last["time"]), last.get("clean") is True
    if booted_since(last):
        event, how = (
            ("rebooted", "after a clean shutdown")
            if clean
            else ("unclean-reboot", "without a clean shutdown (power lost, a kernel panic or a hard reset)")
        )
        alert(config, event, "-", f"the host booted again {how}; the guard last saw it up at {seen}")
        for engine in config["engines"]:
            if read_json(outage_path(config, engine["name"]), None) is None:
                recorded(
                    config,
                    outage_path(config, engine["name"]),
                    {"since": last["time"], "why": "the host rebooted"},
                    f"the outage of {engine['unit']}",
                )
    elif not clean:
        why = last.get("why")
        how = f"died: {shown(why)}" if isinstance(why, str) and why else "stopped answering or died"
        alert(config, "guard-restarted", "-", f"the guard {how} (last alive at {seen}) and systemd started it again")
