"""The host record: what the host was converged against, written after a successful converge."""

from __future__ import annotations

import shlex

from pyinfra import host
from pyinfra.api import operation

from sparkform.hostrecord import HostRecord
from sparkform.schema import HostConfig


@operation()
def host_recorded(config: HostConfig, planned: HostRecord, current: HostRecord | None, started: dict[str, bool]):
    """
    Write the host record (root's, 0644) unless it already says what this run found and the
    run started no engine. Comes last: a failed converge leaves the previous record, so the
    next run reports the same drift.

    + config: the host's validated configuration
    + planned: the record as planned (sparkform.converge.planned_record)
    + current: the record on the host (None: none, or unreadable)
    + started: engine name -> whether its start in this run rebuilt its JIT caches (cold)
    """
    if not started and planned == current:
        host.noop("the host record is up to date")
        return
    units = {engine.name: engine.unit for engine in config.engines}
    measured = " ".join(f"{name}={units[name]}{':cold' if cold else ''}" for name, cold in started.items())
    yield (
        f"python3 {shlex.quote(config.paths.record)} {shlex.quote(config.paths.host_record)} "
        f"{shlex.quote(planned.to_json())} {measured}"
    )
