"""Engine units: reload, enable, and (re)start one at a time, each to readiness before the next."""

from __future__ import annotations

import shlex

from pyinfra import host
from pyinfra.api import operation

from sparkform.deploy.operations.progress import ProgressCommand, printf_line, start_format, ticking
from sparkform.domain.engine import Engine
from sparkform.domain.layout import KEPT_FILES, KEPT_PREVIOUS, KEPT_RECORD, ROOT_PYTHON
from sparkform.host.systemd import FAILURE_REASON_PATTERN, JOURNAL_LINES, WHY_LINE_CHARS
from sparkform.readers.kept import KeptSettings
from sparkform.readers.parsers import EngineState
from sparkform.writers.converge import starts

# The journal on stdin, why a start failed on stdout.
WHY_LINES_FILTER = f"grep -E '{FAILURE_REASON_PATTERN}' | cut -c1-{WHY_LINE_CHARS} | tail -n {JOURNAL_LINES}"


def _explained(command: str, unit: str, rollback: str | None = None) -> str:
    """Run a systemctl command; on failure print why from the unit's journal since then, hand
    those lines to `rollback` (a command reading them on stdin) when there is one, and fail."""
    journal = f'journalctl -u {shlex.quote(unit)} --since "@$since" --no-pager -o cat'
    back = f"printf '%s\\n' \"$why\" | {rollback} >&2; " if rollback else ""
    return (
        f"since=$(date +%s); {command} || {{ rc=$?; why=$({journal} | {WHY_LINES_FILTER}); "
        f"echo 'sparkform: {unit} failed to start; its journal:' >&2; "
        f"printf '%s\\n' \"$why\" >&2; {back}exit $rc; }}"
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
    engine: Engine,
    current: EngineState | None,
    restart: bool,
    cold: bool,
    cold_start_s: float | None,
    budget_s: int,
    rollback_script: str | None = None,
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
    + rollback_script: sparkform-rollback, when a failed start puts the engine back on the
      settings it last served with (EngineStep.rolls_back); the run fails all the same
    """
    commands = _enabled(engine, current)
    if starts(current, restart):
        verb = "restart" if restart else "start"
        progress = printf_line(start_format(engine.name, cold, cold_start_s, budget_s), "$elapsed")
        start = ticking(f"systemctl {verb} {shlex.quote(engine.unit)}", progress)
        serving = printf_line(f"{engine.name}: serving after %d s", '"$(($(date +%s) - since))"')
        rollback = (
            f"{shlex.join(ROOT_PYTHON)} {shlex.quote(rollback_script)} {shlex.quote(engine.name)} --by deploy"
            if rollback_script
            else None
        )
        yield from commands
        yield _reset_failed(engine)
        yield ProgressCommand(f"{_explained(start, engine.unit, rollback)}; {serving}")
    elif commands:
        yield from commands
    else:
        host.noop(f"{engine.unit} is enabled and {current.active_state if current else 'absent'}")


def _enabled(engine: Engine, current: EngineState | None) -> list[str]:
    """`systemctl enable` of the engine's unit, unless it is enabled at boot already."""
    if current is not None and current.unit_file_state == "enabled":
        return []
    return [f"systemctl enable {shlex.quote(engine.unit)}"]


def _reset_failed(engine: Engine) -> str:
    """A unit that hit its start limit would refuse the start otherwise. `start` (after it) joins
    a start already under way (a boot) and cuts short an auto-restart wait."""
    return f"systemctl reset-failed {shlex.quote(engine.unit)} 2>/dev/null || true"


@operation()
def rank_running(engine: Engine, current: EngineState | None, restart: bool):
    """
    Enable a rank > 0 of an engine across hosts at boot and have it running. It has no API to
    wait for: it waits for its head's master port itself, and the head's start (on the head's
    host) returns once every rank joined and a completion ran through them.

    + engine: the engine this host runs a headless rank of
    + current: its unit's state from the HostSnapshot fact (None before the first deploy)
    + restart: its unit, settings or arguments changed, so it must restart to pick them up
    """
    commands = _enabled(engine, current)
    if starts(current, restart):
        commands += [_reset_failed(engine), f"systemctl {'restart' if restart else 'start'} {shlex.quote(engine.unit)}"]
    if not commands:
        host.noop(f"{engine.unit} is enabled and {current.active_state if current else 'absent'}")
    yield from commands


@operation()
def settings_kept(
    kept_dir: str,
    files: tuple[str, str, str],
    wanted: KeptSettings,
    current: KeptSettings | None,
    previous: bool,
    rolled_back: bool,
):
    """
    Keep a copy of the settings the engine serves (its unit, env and args files) with what they
    use, once its start served, and the settings kept before them in `previous/` (what
    `sparkform rollback` goes back to from a change that served): root's folder, replaced whole
    (a new folder, then renames), so a cut-off run leaves the previous copy. Drops a rollback
    record with it: the engine serves the inventory's settings again.

    + kept_dir: the engine's kept folder (layout.kept_dir)
    + files: its unit, env and args files (HostPaths.engine_files)
    + wanted: what they are: the digest as rendered, the venv and the checkpoint folder
    + current: what the host keeps now (None: nothing)
    + previous: the host keeps settings from before `current` too
    + rolled_back: the host holds a rollback record for the engine
    """
    same = current is not None and (current.digest, current.venv, current.checkpoint) == (
        wanted.digest,
        wanted.venv,
        wanted.checkpoint,
    )
    if same and not rolled_back:
        host.noop(f"{kept_dir} keeps the settings {wanted.engine} serves")
        return
    root, _, engine = kept_dir.rpartition("/")
    target = shlex.quote(kept_dir)
    # Dot names: the snapshot fact reads every engine's folder (kept_root/*), never these.
    old, temp = shlex.quote(f"{root}/.{engine}.old"), shlex.quote(f"{root}/.{engine}.XXXXXX")
    copies = [f'cp -- {shlex.quote(path)} "$temp"/{name}' for path, name in zip(files, KEPT_FILES, strict=True)]
    if current is not None and current.digest != wanted.digest:
        # What served until now becomes the settings before these.
        kept = " ".join(shlex.quote(f"{kept_dir}/{name}") for name in (*KEPT_FILES, KEPT_RECORD))
        copies += [f'mkdir "$temp"/{KEPT_PREVIOUS}', f'cp -- {kept} "$temp"/{KEPT_PREVIOUS}/']
    elif previous:
        copies.append(f'cp -R -- {shlex.quote(f"{kept_dir}/{KEPT_PREVIOUS}")} "$temp"/{KEPT_PREVIOUS}')
    yield (
        f"{{ [ -d {shlex.quote(root)} ] || mkdir -m 700 {shlex.quote(root)}; }} "
        f"&& temp=$(mktemp -d {temp}) && {' && '.join(copies)} "
        f'&& printf \'%s\' {shlex.quote(wanted.to_json())} > "$temp"/{KEPT_RECORD} && chmod -R go-rwx "$temp" '
        f'&& rm -rf -- {old} && {{ [ ! -e {target} ] || mv -T -- {target} {old}; }} && mv -T -- "$temp" {target} '
        f"&& rm -rf -- {old}"
    )


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
