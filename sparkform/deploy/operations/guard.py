"""The guard (sparkform-guard.service): watchdog, memory guard and alerts, kept running."""

from __future__ import annotations

import shlex

from pyinfra import host
from pyinfra.api import operation

from sparkform.deploy.operations.files import replaced_file
from sparkform.domain.layout import ROOT_PYTHON
from sparkform.readers.parsers import EngineState


@operation()
def guard_running(unit: str, current: EngineState | None, applied: str | None, wanted: str, stamp: str):
    """
    Enable the guard at boot and have it running with this run's script, settings and units;
    restart it when they differ from what it last started with.

    + unit: the guard's unit (sparkform-guard.service)
    + current: its state from the HostSnapshot fact (None before the first deploy)
    + applied: the stamp on the host, the digest of what it last started with (None: none)
    + wanted: the digest of this run's files
    + stamp: where the stamp lives (root's)
    """
    changed = False
    if current is None or current.unit_file_state != "enabled":
        yield f"systemctl enable {shlex.quote(unit)}"
        changed = True
    if applied != wanted or current is None or current.active_state != "active":
        yield f"systemctl restart {shlex.quote(unit)}"
        yield replaced_file(stamp, wanted)
        changed = True
    if not changed:
        host.noop(f"{unit} is enabled and active")


@operation()
def alerted(guard_script: str, event: str, message: str):
    """
    Send one alert through the guard (journal, webhook, command).

    + guard_script: sparkform-guard on the host (HostPaths.guard)
    + event: what happened (e.g. drift)
    + message: the alert's text (no secret)
    """
    yield (f"{shlex.join(ROOT_PYTHON)} {shlex.quote(guard_script)} alert {shlex.quote(event)} - {shlex.quote(message)}")
