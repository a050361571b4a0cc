"""The front: Debian's nginx in front of the engines, started, or reloaded when its config changed."""

from __future__ import annotations

import shlex

from pyinfra import host
from pyinfra.api import operation

from sparkform.deploy.operations.files import replaced_file
from sparkform.readers.parsers import EngineState

# A reload that cannot bind a port keeps the old configuration and still exits 0 (nginx only
# logs it), so every run that touches the front checks the ports afterwards, for 5 s at most.
LISTEN_CHECKS = 50
LISTEN_CHECK_PAUSE_S = 0.1


def _listening(ports: list[int]) -> str:
    """A shell test that something listens on every port."""
    return " && ".join(f"ss -Hltn {shlex.quote(f'sport = :{port}')} | grep -q ." for port in ports)


@operation()
def worker_connections(path: str, wanted: int, current: int | None):
    """
    Set nginx.conf's worker_connections: with Debian's 768 on two cores, 1,600 idle connections
    without a key took every slot and keyed clients got resets. The front's configuration names
    the value, so nginx reloads onto it (front_serving).

    + path: Debian's main nginx configuration
    + wanted: the inventory's front_connections
    + current: the value the file holds now (None: no such line, or nginx not installed yet)
    """
    if current == wanted:
        host.noop(f"nginx.conf holds worker_connections {wanted}")
        return
    line = "^([[:space:]]*worker_connections[[:space:]]+)[0-9]+;"
    substitution = shlex.quote(f"s/{line}/" + "\\1" + f"{wanted};/")
    result = shlex.quote(f"^[[:space:]]*worker_connections[[:space:]]+{wanted};")
    yield (
        f"sed -i -E {substitution} {shlex.quote(path)} && grep -Eq {result} {shlex.quote(path)} || "
        f"{{ echo 'sparkform: {path} has no worker_connections line to set' >&2; exit 1; }}"
    )


@operation()
def front_serving(
    address: str, ports: list[int], current: EngineState | None, applied: str | None, wanted: str, stamp: str
):
    """
    Enable and start nginx, restart it when its unit drop-in changed, or reload it when its
    configuration (or the API key it includes) changed since it last loaded them; `nginx -t`
    first, every time, so a bad configuration never replaces a working one. Then every port
    must listen, and the stamp records what nginx runs with.

    + address: the listen address of the front (the inventory's listen_address)
    + ports: the ports the front listens on: each engine's, and the combined front_port
    + current: nginx.service's state from the HostSnapshot fact (None before nginx is installed)
    + applied: the stamp on the host, "<drop-in digest> <config digest>" (None: none)
    + wanted: the stamp this run's files make
    + stamp: where the stamp lives (root's)
    """
    if current is None or current.unit_file_state != "enabled":
        yield "systemctl enable nginx.service"
    applied_unit, _, applied_config = (applied or "").partition(" ")
    wanted_unit, _, wanted_config = wanted.partition(" ")
    if current is None or current.active_state != "active" or applied_unit != wanted_unit:
        verb = "restart"
    elif applied_config != wanted_config:
        verb = "reload"
    else:
        if current.unit_file_state == "enabled":
            host.noop("nginx is enabled, active and runs this configuration")
        return
    if applied_unit != wanted_unit:
        yield "systemctl daemon-reload"  # the drop-in may have been written by a run cut short
    yield f"nginx -t -q && systemctl {verb} nginx.service"
    if ports:
        check = _listening(ports)
        yield (
            f"for _ in $(seq {LISTEN_CHECKS}); do {{ {check} ; }} && exit 0; sleep {LISTEN_CHECK_PAUSE_S}; done; "
            f"echo 'sparkform: nginx does not listen on every front port ({address}: "
            f"{' '.join(map(str, ports))}); see: journalctl -u nginx.service, /var/log/nginx/error.log' >&2; exit 1"
        )
    # Root's only: its digest covers the API key, so a readable one would confirm a guessed key offline.
    yield replaced_file(stamp, wanted, mode="600")
