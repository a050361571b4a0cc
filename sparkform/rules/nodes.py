"""The rules across the hosts an engine spans (engines[].nodes): what no single host's data shows.

sparkform.rules.inventory runs them once every host of the inventory has loaded, before any connection.
The ranks of a spanning engine must run the same vLLM from the same lock and serve the same engine
table (checkpoint commit, window, flags) on every node, each node at an address of its own; what a
node needs by itself (its interface, the head's address, the master port, its memory) is checked
with the host (validate.py, planner.py). Each problem names the host whose data must change: a
node that differs from the engine's head, or the head when it names a host the inventory lacks.
"""

from __future__ import annotations

import ipaddress
import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from sparkform.domain import locks
from sparkform.domain.engine import Engine, Span
from sparkform.domain.model import Host, Problem
from sparkform.domain.schema import HostConfig

HOST_PIN_FIELDS = ("device", "python")  # with the engine's own package and version: what picks the vLLM a rank runs
SAME_DATA = "define it once, in the data of the group the engine's nodes share"


def span_problems(hosts: list[Host], names: Iterable[str]) -> list[Problem]:
    """Every problem across the nodes of each spanning engine of `hosts` (the hosts that loaded;
    `names` are all of the inventory's, so a host that failed to load is not reported missing)."""
    known = list(names)
    by_name = {host.name: host for host in hosts}
    problems = []
    for reference, engine in _spanning_engines(hosts):
        addresses: dict[str, str] = {}
        for node in engine.nodes:
            if node not in known:
                problems.append(
                    Problem(
                        reference.name,
                        "nodes",
                        node,
                        "no host of this inventory is named so",
                        f"name hosts of this inventory ({', '.join(known)})",
                        engine.name,
                    )
                )
                continue
            host = by_name.get(node)
            if host is None:
                continue  # its own problems are reported
            if host is not reference:
                problems += _differences(reference, engine, host)
            address = host.config.node_address
            if address is None:
                continue
            if address in addresses:
                problems.append(
                    Problem(
                        node,
                        "node_address",
                        address,
                        f"node {addresses[address]} of the engine has this address too",
                        "give each node its own address on the link",
                        engine.name,
                    )
                )
            addresses.setdefault(address, node)
    return problems


def _spanning_engines(hosts: list[Host]) -> list[tuple[Host, Engine]]:
    """Each spanning engine once (an engine is its name and its head), as the host it is compared
    against holds it: the head, else the first host that holds it."""
    found: dict[tuple[str, str | None], tuple[Host, Engine]] = {}
    for host in hosts:
        for engine in host.config.engines:
            if not engine.nodes:
                continue
            key = (engine.name, engine.head)
            if key not in found or host.name == engine.head:
                found[key] = (host, engine)
    return list(found.values())


def _differences(reference: Host, engine: Engine, node: Host) -> list[Problem]:
    """What `node` holds differently from `reference` for `engine`: its vLLM, its lock, its table."""
    theirs = next((other for other in node.config.engines if other.name == engine.name), None)
    if theirs is None:
        return [
            Problem(
                node.name,
                "engines",
                [other.name for other in node.config.engines],
                f"{reference.name} names this host a node of the engine, but this host's engines hold none of "
                "that name",
                f"give this host the engine: {SAME_DATA}",
                engine.name,
            )
        ]
    reference_pin, node_pin = reference.config.pin(engine), node.config.pin(theirs)
    vllm = [
        ("vllm_package", reference_pin.package, node_pin.package),
        ("vllm_version", reference_pin.version, node_pin.version),
        *((name, getattr(reference.config, name), getattr(node.config, name)) for name in HOST_PIN_FIELDS),
    ]
    # The engine's own vLLM is compared as the pin it makes (above) and the lock's bytes (below).
    table = [
        (name, _plain(getattr(engine, name)), _plain(getattr(theirs, name)))
        for name in Engine.model_fields
        if name not in ("vllm_version", "lock_file")
    ]
    compared = [(*row, "every rank of the engine must run the same vLLM") for row in vllm] + [
        (*row, "every rank must serve the same engine") for row in table
    ]
    problems = [
        Problem(
            node.name,
            name,
            other,
            f"{reference.name} has {ours!r}: {why}",
            f"set {name} to {ours!r} on every node of the engine: {SAME_DATA}",
            engine.name,
        )
        for name, ours, other, why in compared
        if ours != other
    ]
    return problems + _lock_difference(reference, engine, node, theirs)


def _plain(value: object) -> object:
    """A field's value as the inventory writes it (a table as a dict)."""
    return value.model_dump() if isinstance(value, BaseModel) else value


def _lock_difference(reference: Host, engine: Engine, node: Host, theirs: Engine) -> list[Problem]:
    """Two locks of the same pin still install two sets of packages (a torch or NCCL apart)."""
    ours, other = Path(reference.config.pin(engine).lock), Path(node.config.pin(theirs).lock)
    if not (ours.is_file() and other.is_file()) or locks.lock_id(ours) == locks.lock_id(other):
        return []  # a missing lock is its host's own problem
    return [
        Problem(
            node.name,
            "lock_file",
            str(other),
            f"{reference.name} installs {ours} (lock {locks.lock_id(ours)}), this host lock {locks.lock_id(other)}: "
            "every rank must run the same packages",
            f"point lock_file at the same lock on every node of the engine: {SAME_DATA}",
            engine.name,
        )
    ]


# --- at deploy: where this node's ranks meet, and the preflight ----------------------------------

LINK_ADDRESS = re.compile(r"[0-9a-fA-F.:]{2,45}/[0-9]{1,3}")  # `ip -o addr` of the interface, with its prefix
NCCL_LIBRARY = re.compile(r"/[A-Za-z0-9._/+-]{1,400}/libnccl\.so[0-9.]*")
NCCL_DIST = re.compile(r"nvidia_nccl[A-Za-z0-9_]*-([0-9][A-Za-z0-9.+]{0,40})\.dist-info")
HEAD_REACH = ("open", "refused", "unreachable")


@dataclass(frozen=True)
class NodeLink:
    """What the NodeLink fact read on a node: its rank interface, the NCCL in its venv, whether it
    reaches the head's master port. Every value matched a pattern; what did not is in `untrusted`."""

    interface: str
    present: bool = False
    addresses: tuple[str, ...] = ()  # address/prefix, as `ip -o addr` lists them
    mtu: int | None = None
    nccl_libraries: tuple[str, ...] = ()
    nccl_versions: tuple[str, ...] = ()
    head: str | None = None  # "open", "refused" (a host answered: nothing listens yet) or "unreachable"
    untrusted: tuple[str, ...] = ()


def node_link_command(interface: str, venv: str, head: tuple[str, int] | None) -> str:
    """The shell that reads a node's link (one line per value) for the NodeLink fact."""
    quoted, sys_path, venv_path = shlex.quote(interface), shlex.quote(f"/sys/class/net/{interface}"), shlex.quote(venv)
    lines = [
        f"if [ -e {sys_path} ]; then echo present; echo mtu $(cat {sys_path}/mtu);",
        f"ip -o addr show dev {quoted} scope global | awk '{{print \"address\", $4}}'; else echo absent; fi;",
        f"find {venv_path} -name 'libnccl.so*' -type f -printf 'nccl %p\\n' 2>/dev/null;",
        f"find {venv_path}/lib -maxdepth 3 -name 'nvidia_nccl*.dist-info' -printf 'nccl_dist %f\\n' 2>/dev/null;",
    ]
    if head is not None:
        target = shlex.quote(f"/dev/tcp/{head[0]}/{head[1]}")
        lines.append(
            f"why=$(timeout 3 bash -c 'exec 3<>\"$1\"' _ {target} 2>&1); case $? in 0) echo head open;; "
            "124) echo head unreachable;; *) case $why in *refused*) echo head refused;; *) echo head unreachable;; "
            "esac;; esac;"
        )
    return " ".join(lines) + " true"


def parse_node_link(interface: str, lines: list[str]) -> NodeLink:
    """The NodeLink fact's lines, each value checked against its pattern."""
    found: dict[str, Any] = {"present": False, "addresses": [], "nccl_libraries": [], "nccl_versions": []}
    untrusted = []
    for line in lines:
        key, _, value = line.strip().partition(" ")
        if key in ("present", "absent") and not value:
            found["present"] = key == "present"
        elif key == "mtu" and value.isdigit() and len(value) <= 6:
            found["mtu"] = int(value)
        elif key == "address" and LINK_ADDRESS.fullmatch(value) and _interface_address(value):
            found["addresses"].append(value)
        elif key == "nccl" and NCCL_LIBRARY.fullmatch(value) and ".." not in value:
            found["nccl_libraries"].append(value)
        elif key == "nccl_dist" and (match := NCCL_DIST.fullmatch(value)):
            found["nccl_versions"].append(match.group(1))
        elif key == "head" and value in HEAD_REACH:
            found["head"] = value
        elif line.strip():
            untrusted.append(line.strip()[:200])
    return NodeLink(
        interface,
        found["present"],
        tuple(found["addresses"]),
        found.get("mtu"),
        tuple(found["nccl_libraries"]),
        tuple(found["nccl_versions"]),
        found.get("head"),
        tuple(untrusted),
    )


def _interface_address(text: str) -> ipaddress.IPv4Interface | ipaddress.IPv6Interface | None:
    try:
        return ipaddress.ip_interface(text)
    except ValueError:
        return None


def head_address(engine: Engine, peers: dict[str, HostConfig]) -> str | None:
    """The head's node_address, from the head's own data (where the workers' --master-addr is set)."""
    head = peers.get(engine.head or "")
    return None if head is None else head.node_address


def spans(
    host: str, config: HostConfig, peers: dict[str, HostConfig], link: NodeLink
) -> tuple[dict[str, Span], list[Problem]]:
    """Where each spanning engine of `host` meets, from the head's data and this node's link; the
    preflight's problems instead when the link cannot carry the ranks."""
    engines = [engine for engine in config.enabled_engines if engine.nodes]
    if not engines:
        return {}, []
    interface = config.node_interface or ""
    problems = []
    if not link.present:
        problems.append(
            Problem(
                host,
                "node_interface",
                interface,
                "no such interface on the host",
                "set node_interface to the ConnectX-7 port as `ip -br link` on the host names it",
            )
        )
    own = next(
        (
            ipaddress.ip_interface(text)
            for text in link.addresses
            if config.node_address in (None, str(ipaddress.ip_interface(text).ip))
        ),
        None,
    )
    if link.present and own is None:
        problems.append(
            Problem(
                host,
                "node_address" if config.node_address else "node_interface",
                config.node_address or interface,
                f"{interface} has {', '.join(link.addresses) or 'no address'}"
                + (f", not {config.node_address}" if config.node_address else ""),
                f"give {interface} its address on the link (e.g. with netplan or NetworkManager), "
                "or set node_address to the one it has",
            )
        )
    if len(link.nccl_versions) > 1:
        problems.append(
            Problem(
                host,
                "lock_file",
                list(link.nccl_versions),
                "the venv holds more than one NCCL: two libraries load at once and the ranks hang or crash",
                "keep one nvidia-nccl package in the lock",
            )
        )
    result = {}
    for engine in engines:
        master = head_address(engine, peers)
        if master is None:
            problems.append(
                Problem(
                    host,
                    "node_address",
                    None,
                    f"the head {engine.head} has no node_address",
                    f"set node_address on {engine.head}",
                    engine.name,
                )
            )
        elif own is not None:
            result[engine.name] = Span(master, str(own.ip), str(own.network))
    return result, problems


def preflight_lines(host: str, config: HostConfig, link: NodeLink) -> list[str]:
    """What the preflight saw on this node, for the log and the dry run."""
    if not any(engine.nodes for engine in config.enabled_engines):
        return []
    state = "present" if link.present else "MISSING"
    lines = [
        f"[{host}] preflight: {link.interface} {state}, "
        f"address {', '.join(link.addresses) or 'none'}, MTU {link.mtu if link.mtu is not None else '?'}"
    ]
    nccl = ", ".join(link.nccl_versions) or ("none" if not link.nccl_libraries else "unversioned")
    lines.append(f"[{host}] preflight: NCCL in the venv: {nccl} ({len(link.nccl_libraries)} libnccl file(s))")
    if link.head is not None:
        reach = {
            "open": "answers",
            "refused": "reachable (nothing listens yet)",
            "unreachable": "UNREACHABLE: check the cable, the addresses and the firewall",
        }[link.head]
        lines.append(f"[{host}] preflight: the head's master port {reach}")
    if link.mtu is not None and link.mtu < 9000:
        lines.append(f"[{host}] preflight: MTU {link.mtu} below the pair's jumbo frames (9000) slows the ranks")
    return lines + [f"[{host}] preflight: untrusted line ignored: {line}" for line in link.untrusted]
