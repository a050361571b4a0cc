"""The rules across the hosts an engine spans (engines[].nodes): what no single host's data shows.

sparkform.inventory runs them once every host of the inventory has loaded, before any connection.
The ranks of a spanning engine must run the same vLLM from the same lock and serve the same engine
table (checkpoint commit, window, flags) on every node, each node at an address of its own; what a
node needs by itself (its interface, the head's address, the master port, its memory) is checked
with the host (validate.py, planner.py). Each problem names the host whose data must change: a
node that differs from the engine's head, or the head when it names a host the inventory lacks.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel

from sparkform import locks
from sparkform.engine import Engine
from sparkform.model import Host, Problem
from sparkform.schema import HostConfig

PIN_FIELDS = ("vllm_package", "vllm_version", "device", "python")  # what picks the vLLM a rank runs
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


def not_deployable(host: str, config: HostConfig) -> list[Problem]:
    """The deploy's refusal of an engine across hosts until the units that run one exist
    (docs/two-sparks.md): converged today, each node would serve it alone."""
    return [
        Problem(
            host,
            "nodes",
            engine.nodes,
            "the deploy runs no engine across hosts yet (validated and planned only): each node would serve it alone",
            "leave nodes out of inventories you converge until the multi-node units land (docs/two-sparks.md)",
            engine.name,
        )
        for engine in config.engines
        if engine.nodes
    ]


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
    vllm = [(name, getattr(reference.config, name), getattr(node.config, name)) for name in PIN_FIELDS]
    table = [(name, _plain(getattr(engine, name)), _plain(getattr(theirs, name))) for name in Engine.model_fields]
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
    return problems + _lock_difference(reference, engine, node)


def _plain(value: object) -> object:
    """A field's value as the inventory writes it (a table as a dict)."""
    return value.model_dump() if isinstance(value, BaseModel) else value


def _lock_difference(reference: Host, engine: Engine, node: Host) -> list[Problem]:
    """Two locks of the same pin still install two sets of packages (a torch or NCCL apart)."""
    ours, other = Path(reference.config.lock), Path(node.config.lock)
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
