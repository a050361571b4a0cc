"""The host record: what the host was converged against, written after a successful converge."""

from __future__ import annotations

import shlex
from dataclasses import replace

from pyinfra import host
from pyinfra.api import operation

from facts.host import HostSnapshot
from sparkform.hostrecord import EngineRecord, HostRecord, HostVersions, cache_key, record_path
from sparkform.schema import HostConfig


def planned_record(config: HostConfig, live: HostVersions, record: HostRecord | None,
                   snapshot: HostSnapshot) -> HostRecord:
    """The record as this run will leave it, with the boot's starts that systemd measured; starts
    this run makes are measured on the host when it writes the record. A restart systemd made on
    its own later in the same boot is not a change to converge (a dry-run after a crash shows
    none): the record keeps the boot's start."""
    engines = {}
    for engine in config.enabled_engines:
        old = record.engines.get(engine.name) if record else None
        entry = EngineRecord(cache_key(live)) if old is None else replace(old, cache_key=cache_key(live))
        state = snapshot.engines.get(engine.unit)
        recorded_this_boot = (entry.started_at is not None and snapshot.booted_at is not None
                              and entry.started_at >= snapshot.booted_at)
        if (state and state.started_at and state.start_s and state.started_at != entry.started_at
                and not recorded_this_boot):
            entry = replace(entry, started_at=state.started_at, start_s=state.start_s, last_start_cold=False)
        engines[engine.name] = entry
    return HostRecord(live, engines)


@operation()
def host_recorded(config: HostConfig, planned: HostRecord, current: HostRecord | None,
                  started: dict[str, bool]):
    """
    Write the host record (root's, 0644) unless it already says what this run found and the
    run started no engine. Comes last: a failed converge leaves the previous record, so the
    next run reports the same drift.

    + config: the host's validated configuration
    + planned: the record as planned (see planned_record)
    + current: the record on the host (None: none, or unreadable)
    + started: engine name -> whether its start in this run rebuilt its JIT caches (cold)
    """
    if not started and planned == current:
        host.noop("the host record is up to date")
        return
    units = {engine.name: engine.unit for engine in config.engines}
    measured = " ".join(f"{name}={units[name]}{':cold' if cold else ''}" for name, cold in started.items())
    yield (f"python3 {shlex.quote(config.lib_dir)}/sparkform-record {shlex.quote(record_path(config.state_dir))} "
           f"{shlex.quote(planned.to_json())} {measured}")
