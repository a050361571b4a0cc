"""The boot chain: which engines each engine starts after, the order a converge starts them in,
what is wrong with an inventory's chain, the holes a host's units have, and whether a run repairs
one. Render (After= lines), validation, the deploy and `sparkform/verify` all take it from here.

After= orders only units in the same boot transaction, so an edge to a unit that is not enabled
orders nothing and both engines start at once: the compile storm of two cold starts
(docs/incidents.md#boot-chain-hole).
"""

from __future__ import annotations

import hashlib

from sparkform.domain.engine import Engine
from sparkform.domain.layout import UNIT_PREFIX
from sparkform.domain.model import Host, Problem
from sparkform.domain.rendered import RenderedFile
from sparkform.domain.schema import HostConfig

ORDERING = "After="  # an engine unit's only ordering line (templates/engine.service.j2)


def order_blind_digest(unit_text: str) -> str:
    """The sha256 of a unit file's text less its After= lines, each line ending in a newline, as
    `grep -v '^After='` prints it (the host side: HostSnapshot): two unit files with the same digest
    differ in boot order alone, which systemd takes on a reload, without restarting the engine."""
    kept = (line.rstrip("\n") + "\n" for line in unit_text.splitlines() if not line.startswith(ORDERING))
    return hashlib.sha256("".join(kept).encode()).hexdigest()


def ordering_only(unit: RenderedFile, order_blind: dict[str, str]) -> bool:
    """Whether the host's copy of `unit` (a unit file rendered to replace it) differs from it in
    After= lines alone (`order_blind`: the host's order-blind digests, by path): an engine before
    it was disabled or removed, and the running engine is reloaded into its new order, not restarted."""
    return unit.is_unit and order_blind.get(unit.path) == order_blind_digest(unit.content)


def edges(config: HostConfig, engine: Engine) -> list[str]:
    """The enabled engines `engine` starts after: its `after` list, each disabled engine replaced
    by the engines it comes after, so the chain stays whole when an engine in the middle is
    disabled."""
    by_name = {e.name: e for e in config.engines}
    found: list[str] = []
    pending, seen = list(engine.after), {engine.name}
    while pending:
        name = pending.pop(0)
        if name in seen or name not in by_name:
            continue
        seen.add(name)
        if by_name[name].enabled:
            found.append(name)
        else:
            pending += by_name[name].after
    return found


def after_units(config: HostConfig, engine: Engine) -> list[str]:
    """The units of those engines: the engine unit's After= beside network-online.target."""
    by_name = {e.name: e for e in config.engines}
    return [by_name[name].unit for name in edges(config, engine)]


def start_order(config: HostConfig) -> list[Engine]:
    """The enabled engines in an order where each comes after every engine it waits for."""
    remaining = {engine.name: engine for engine in config.enabled_engines}
    ordered: list[Engine] = []
    while remaining:
        ready = [e for e in remaining.values() if not set(edges(config, e)) & set(remaining)]
        if not ready:
            raise ValueError(f"cycle among {sorted(remaining)}")
        for engine in ready:
            ordered.append(remaining.pop(engine.name))
    return ordered


def chain_problems(host: Host) -> list[Problem]:
    """Edges to itself or to no engine, and cycles: an inventory whose chain cannot be kept."""
    problems = []
    by_name = {engine.name: engine for engine in host.config.engines}
    for engine in host.config.enabled_engines:
        for target in engine.after:
            if target == engine.name:
                problems.append(
                    Problem(
                        host.name, "after", target, "an engine cannot wait for itself", "remove the edge", engine.name
                    )
                )
            elif target not in by_name:
                problems.append(
                    Problem(
                        host.name,
                        "after",
                        target,
                        "no engine of that name: the After= edge would order against nothing, "
                        "the boot chain's hole (two cold starts in the same second: docs/incidents.md#boot-chain-hole)",
                        f"name one of: {', '.join(sorted(by_name)) or '(no engines)'}",
                        engine.name,
                    )
                )
    if not problems:
        try:
            start_order(host.config)
        except ValueError:
            problems.append(
                Problem(
                    host.name,
                    "after",
                    {e.name: e.after for e in host.config.engines},
                    "the after edges form a cycle, so no engine could start first",
                    "break the cycle",
                )
            )
    return problems


def holes(after: dict[str, tuple[str, ...]], unit_files: dict[str, str]) -> list[tuple[str, str, str]]:
    """Edges of the boot chain that order an enabled unit after an engine unit that is not
    enabled (docs/incidents.md#boot-chain-hole: After= orders only units in the same boot
    transaction, so such an edge orders nothing and both start at once).

    + after: each enabled unit's After= list, by unit
    + unit_files: the file state (enabled, disabled, ...) of every engine unit on the host
    Returns (unit, the unit it waits for, that unit's state or "missing").
    """
    return [
        (unit, dep, unit_files.get(dep, "missing"))
        for unit, deps in sorted(after.items())
        for dep in deps
        if dep.startswith(UNIT_PREFIX) and unit_files.get(dep) != "enabled"
    ]


def hole_repaired(unit: str, dep: str, order: list[Engine], changed_units: set[str]) -> bool:
    """Whether this run repairs the hole `unit` -> `dep`: it rewrites the unit, or enables and
    starts `dep`, or `unit` is no engine this run keeps (it is disabled or removed)."""
    return unit in changed_units or any(e.unit == dep for e in order) or not any(e.unit == unit for e in order)
