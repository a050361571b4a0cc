"""Engine units: reload, enable, and (re)start one at a time, each to readiness before the next."""

from __future__ import annotations

import shlex

from pyinfra import host
from pyinfra.api import operation

from sparkform.converge import starts
from sparkform.engine import Engine
from sparkform.parsers import EngineState
from tasks.progress import ProgressCommand, printf_line, start_format, ticking

JOURNAL_LINES = 30
# Journal lines that say why a start failed: exceptions, refusals, the helper's verdict.
FAILURE_REASON_PATTERN = r"(Error|error:|exceeds|refus|sparkform-|Failed with result|start request repeated)"


def _explained(command: str, unit: str) -> str:
    """Run a systemctl command; on failure print why from the unit's journal since then, and fail."""
    journal = f"journalctl -u {shlex.quote(unit)} --since @$since --no-pager -o cat"
    return (
        f"since=$(date +%s); {command} || {{ rc=$?; echo 'sparkform: {unit} failed to start; "
        f"its journal:' >&2; {journal} | grep -E '{FAILURE_REASON_PATTERN}' | tail -n {JOURNAL_LINES} >&2; exit $rc; }}"
    )


@operation()
def daemon_reload(needed: bool):
    """
    Reload systemd's units, only when a unit file changed.

    + needed: whether a unit file changes in this run
    """
    if not needed:
        host.noop("no unit file changed")
        return
    yield "systemctl daemon-reload"


@operation()
def engine_running(
    engine: Engine, current: EngineState | None, restart: bool, cold: bool, cold_start_s: float | None, budget_s: int
):
    """
    Enable an engine at boot and have it serving; `systemctl` returns only once the readiness
    helper (ExecStartPost) reports it serving, so the next engine never starts beside a cold one.
    Meanwhile a line every PROGRESS_EVERY_S seconds says how long it has been starting, against
    its recorded cold start.

    + engine: the engine
    + current: its unit's state from the HostSnapshot fact (None before the first deploy)
    + restart: its unit, settings or arguments changed, so it must restart to pick them up
    + cold: that start rebuilds its JIT caches
    + cold_start_s: its last cold start in seconds, from the host record or the inventory (None: never measured)
    + budget_s: the readiness helper's budget (readiness_budget_s)
    """
    changed = False
    if current is None or current.unit_file_state != "enabled":
        yield f"systemctl enable {shlex.quote(engine.unit)}"
        changed = True
    if starts(current, restart):
        # reset-failed: a unit that hit its start limit would refuse the start otherwise. `start`
        # joins a start already under way (a boot) and cuts short an auto-restart wait.
        yield f"systemctl reset-failed {shlex.quote(engine.unit)} 2>/dev/null || true"
        verb = "restart" if restart else "start"
        progress = printf_line(start_format(engine.name, cold, cold_start_s, budget_s), "$elapsed")
        start = ticking(f"systemctl {verb} {shlex.quote(engine.unit)}", progress)
        serving = printf_line(f"{engine.name}: serving after %d s", '"$(($(date +%s) - since))"')
        yield ProgressCommand(f"{_explained(start, engine.unit)}; {serving}")
        changed = True
    if not changed:
        host.noop(f"{engine.unit} is enabled and {current.active_state}")


@operation()
def engine_removed(unit_path: str, settings: list[str]):
    """
    Stop, disable and delete an engine that left the inventory, so no unit sparkform wrote
    outlives it (a forgotten enabled unit starts at boot, outside the chain).

    + unit_path: the unit file sparkform rendered for it
    + settings: its settings files (env, args)
    """
    unit = unit_path.rsplit("/", 1)[-1]
    yield f"systemctl disable --now {shlex.quote(unit)} || true"
    yield "rm -f " + " ".join(shlex.quote(path) for path in [unit_path, *settings])


@operation()
def engine_stopped(engine: Engine, current: EngineState | None):
    """
    Stop and disable an engine the inventory marks disabled.

    + engine: the engine
    + current: its unit's state from the HostSnapshot fact
    """
    if current is None or (current.unit_file_state != "enabled" and current.active_state == "inactive"):
        host.noop(f"{engine.unit} is stopped and disabled")
        return
    yield f"systemctl disable --now {shlex.quote(engine.unit)}"


@operation()
def target_reached(unit: str, current: EngineState | None, engines_started: bool):
    """
    Enable the engines target and reach it: it waits for nothing once every engine serves, and
    stops with an engine this run stopped, so it is started again whenever an engine was.

    + unit: the target (sparkform-engines.target)
    + current: its state from the HostSnapshot fact
    + engines_started: this run (re)started an engine
    """
    changed = False
    if current is None or current.unit_file_state != "enabled":
        yield f"systemctl enable {shlex.quote(unit)}"
        changed = True
    if engines_started or current is None or current.active_state != "active":
        yield f"systemctl start {shlex.quote(unit)}"
        changed = True
    if not changed:
        host.noop(f"{unit} is enabled and active")
