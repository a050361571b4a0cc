"""The checkpoint scrub (sparkform-scrub.timer): armed on its schedule, or stopped when the inventory turns it off."""

from __future__ import annotations

import shlex

from pyinfra import host
from pyinfra.api import operation

from sparkform.deploy.operations.guard import guard_running
from sparkform.readers.parsers import EngineState


@operation()
def scrub_timer(enabled: bool, unit: str, current: EngineState | None, applied: str | None, wanted: str, stamp: str):
    """
    Enable and start the scrub's timer, restarting it (which re-arms its schedule) whenever its
    unit differs from what it was last started with; when the scrub is off, stop and disable it.
    The scrub's service is a one-shot run: its script and settings are read at each run.

    + enabled: whether the inventory wants the scrub (scrub.enabled)
    + unit: the timer (sparkform-scrub.timer)
    + current: its state from the HostSnapshot fact (None before the first deploy)
    + applied: the stamp on the host, the digest of the timer it last started with (None: none)
    + wanted: the digest of this run's timer
    + stamp: where the stamp lives (root's)
    """
    if enabled:
        yield from guard_running._inner(unit=unit, current=current, applied=applied, wanted=wanted, stamp=stamp)
    elif current is not None and (current.unit_file_state == "enabled" or current.active_state == "active"):
        yield f"systemctl disable --now {shlex.quote(unit)}"
    else:
        host.noop(f"{unit} is off, as the inventory wants")
