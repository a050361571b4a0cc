"""Monitoring: Debian's prometheus-node-exporter, installed and kept running with sparkform's settings."""

from __future__ import annotations

import shlex

from pyinfra.api import operation

from sparkform.deploy.operations.guard import guard_running
from sparkform.readers.parsers import EngineState


@operation()
def node_exporter_serving(
    package: str, installed: bool, unit: str, current: EngineState | None, applied: str | None, wanted: str, stamp: str
):
    """
    Install node_exporter if missing, keeping the settings this run already wrote (its ARGS in
    /etc/default are a conffile of the package: --force-confold, so its first start already
    listens where the inventory says); then, as the guard, enabled and restarted whenever its
    settings or drop-in differ from what it last started with.

    + package: the Debian package (prometheus-node-exporter)
    + installed: whether the host has it (the HostSnapshot fact)
    + unit: its unit (prometheus-node-exporter.service)
    + current: its state from the HostSnapshot fact (None before it is installed)
    + applied: the stamp on the host, the digest of what it last started with (None: none)
    + wanted: the digest of this run's settings and drop-in
    + stamp: where the stamp lives (root's)
    """
    if not installed:
        install = (
            "DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "
            f"-o Dpkg::Options::=--force-confold {shlex.quote(package)}"
        )
        yield f"{install} || {{ apt-get update && {install} ; }}"
    yield from guard_running._inner(unit=unit, current=current, applied=applied, wanted=wanted, stamp=stamp)
