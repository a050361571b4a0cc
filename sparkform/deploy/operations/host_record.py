"""The host record: what the host was converged against, written after a successful converge."""

from __future__ import annotations

import shlex

from pyinfra import host
from pyinfra.api import operation

from sparkform.domain.layout import ROOT_PYTHON
from sparkform.domain.schema import HostConfig
from sparkform.readers.hostrecord import HostRecord
from sparkform.readers.snapshot import RemoteFile


@operation()
def host_recorded(
    config: HostConfig,
    planned: HostRecord,
    current: HostRecord | None,
    started: dict[str, bool],
    textfile: RemoteFile | None = None,
):
    """
    Write the host record (root's, 0644), and with monitoring on its metrics for node_exporter,
    unless the record already says what this run found, the run started no engine and the
    metrics are there. Comes last: a failed converge leaves the previous record, so the next
    run reports the same drift.

    + config: the host's validated configuration
    + planned: the record as planned (sparkform.writers.converge.planned_record)
    + current: the record on the host (None: none, or unreadable)
    + started: engine name -> whether its start in this run rebuilt its JIT caches (cold)
    + textfile: the record's metrics on the host (monitoring.record_textfile; None: absent)
    """
    metrics_missing = config.monitoring.enabled and textfile is None
    if not started and planned == current and not metrics_missing:
        host.noop("the host record is up to date")
        return
    units = {engine.name: engine.unit for engine in config.engines}
    measured = " ".join(f"{name}={units[name]}{':cold' if cold else ''}" for name, cold in started.items())
    metrics = f"--textfile {shlex.quote(config.monitoring.record_textfile)} " if config.monitoring.enabled else ""
    yield (
        f"{shlex.join([*ROOT_PYTHON, config.paths.record])} {metrics}{shlex.quote(config.paths.host_record)} "
        f"{shlex.quote(planned.to_json())} {measured}"
    )
