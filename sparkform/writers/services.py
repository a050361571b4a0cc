"""The services the deploy keeps running beside the engines: the front (nginx), the guard, the
scrub's timer and node_exporter. Each one's stamp on the host holds the digest of the files it last
(re)started with, so a run that renders other files restarts or reloads it. `service_steps` is the
table the deploy walks after the engines, one row per service (sparkform/deploy/converge.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from sparkform.domain import layout
from sparkform.domain.schema import HostConfig
from sparkform.readers.parsers import EngineState
from sparkform.readers.snapshot import Snapshot
from sparkform.rules.front_tls import FrontCertificate
from sparkform.writers.programs import guard_files
from sparkform.writers.render import node_exporter_files

# Bumped when the front's stamp changes form: a host with the old one reloads nginx once and gets
# the new (2: root's only, where 1 was world-readable).
FRONT_STAMP_FORMAT = "2"


def digest(*contents: str) -> str:
    """A short digest of what a service was (re)loaded with, kept in its applied stamp."""
    return hashlib.sha256("\0".join(contents).encode()).hexdigest()[:32]


def service_digests(
    config: HostConfig, contents: Mapping[str, str], certificate: FrontCertificate | None
) -> dict[str, str]:
    """What each service must run with, by its stamp's name (`contents`: this run's files and
    secrets by path). The front's stamp has two digests: a new drop-in restarts nginx, the rest
    reloads it."""
    return {
        # The router is compiled when nginx loads its config: a new one needs a reload too.
        "nginx": f"{digest(contents[layout.FRONT_DROP_IN])} "
        + digest(
            FRONT_STAMP_FORMAT,
            contents[layout.FRONT_CONFIG],
            contents.get(config.paths.front_key, ""),
            contents[config.paths.front_router],
            certificate.pem if certificate else "",
        ),
        "guard": digest(*(contents[path] for path in guard_files(config))),
        "scrub": digest(contents[layout.unit_path(layout.SCRUB_TIMER)]),
        "node-exporter": digest(*(f.content for f in node_exporter_files(config))),
    }


def service_units(config: HostConfig) -> dict[str, str]:
    """The services this host keeps, by their stamp's name, each with its unit, in the order the
    deploy keeps them: the front, the guard, the scrub's timer, and node_exporter while monitoring
    is on."""
    units = {"nginx": layout.FRONT_UNIT, "guard": layout.GUARD_UNIT, "scrub": layout.SCRUB_TIMER}
    return units | ({"node-exporter": layout.NODE_EXPORTER_UNIT} if config.monitoring.enabled else {})


@dataclass(frozen=True)
class ServiceStep:
    """One service's turn: what its operation hears. The deploy maps `service` to that operation;
    `options` holds the arguments only that operation takes."""

    service: str  # its stamp's name: nginx, guard, scrub or node-exporter
    name: str  # the operation's name
    options: Mapping[str, object]  # the arguments only its operation takes (the front's address and ports, a unit)
    current: EngineState | None  # its unit's state (None: not on the host yet)
    applied: str | None  # its stamp on the host (None: none yet)
    wanted: str  # the stamp this run's files make (service_digests)
    stamp: str  # where the stamp lives (root's)

    @property
    def arguments(self) -> dict[str, object]:
        """The keyword arguments of its operation, all but its name."""
        return dict(current=self.current, applied=self.applied, wanted=self.wanted, stamp=self.stamp, **self.options)


def service_steps(
    config: HostConfig, snapshot: Snapshot, wanted: Mapping[str, str], served_ports: list[int]
) -> list[ServiceStep]:
    """The steps of the services this host keeps (service_units), in order (`wanted`:
    service_digests; `served_ports`: the ports of the engines this host serves, which the front
    takes over)."""
    scrub, package = config.scrub, layout.NODE_EXPORTER_PACKAGE
    # The combined port only once an engine serves behind it.
    ports = served_ports + ([config.front_port] if config.front_port and served_ports else [])
    # Each service's operation name, and the arguments only its operation takes.
    table: dict[str, tuple[str, Mapping[str, object]]] = {
        "nginx": ("Front (nginx) serving", dict(address=config.listen_address, ports=ports)),
        "guard": ("Guard (watchdog, memory guard, alerts) running", dict(unit=layout.GUARD_UNIT)),
        "scrub": (
            f"Checkpoint scrub ({scrub.period})" if scrub.enabled else "Checkpoint scrub off",
            dict(enabled=scrub.enabled, unit=layout.SCRUB_TIMER),
        ),
        "node-exporter": (
            "node_exporter (systemd and textfile collectors) serving",
            dict(package=package, installed=package in snapshot.installed_packages, unit=layout.NODE_EXPORTER_UNIT),
        ),
    }
    return [
        ServiceStep(
            service,
            *table[service],
            current=snapshot.engines.get(unit),
            applied=snapshot.markers.get(config.paths.stamp(service)),
            wanted=wanted[service],
            stamp=config.paths.stamp(service),
        )
        for service, unit in service_units(config).items()
    ]
