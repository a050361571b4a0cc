"""`sparkform plan [INVENTORY] [--json] [--resolve] [--from-host | --ledger FILE]`: validate an
inventory and print each host's memory plan, each engine's vLLM and checkpoint, and what a deploy
still needs. It connects only when asked: --resolve asks the hub, --from-host each host's ledger.

Exit codes: 0, also while files a deploy needs are missing (listed after the plan); 1 a ledger
asked for could not be read (the plan is printed without it); 2 the inventory is invalid.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sparkform.commands import ledger as ledger_command
from sparkform.commands.hub import resolve_pins
from sparkform.domain.model import Host
from sparkform.domain.schema import HostConfig
from sparkform.reports import ledger
from sparkform.rules import planner
from sparkform.rules.inventory import INVENTORY_HELP, load_inventory, planning


def run(args: argparse.Namespace) -> int:
    """Exit code: 0, also while files a deploy needs are missing (listed after the plan); 1 a
    ledger asked for could not be read (the plan is printed without it)."""
    with planning():
        hosts = load_inventory(args.inventory)
    if args.resolve:
        hosts = [Host(h.name, h.config.pinned(resolve_pins(h.name, h.config, {})), h.model_configs) for h in hosts]
    notes: dict[str, list[str]] = {h.name: [] for h in hosts}
    unread = False
    if args.from_host or args.ledger:
        try:
            ledgers = (
                {entry.host: entry for entry in ledger_command.read_hosts(args.inventory, hosts)}
                if args.from_host
                else ledger_command.load_file(args.ledger)
            )
        except ValueError as err:
            print(f"sparkform plan: {err}", file=sys.stderr)
            return 1
        hosts, notes, unread = _planned_with_ledgers(hosts, ledgers)
    plans = [planner.plan(host) for host in hosts]
    if args.json:
        print(
            json.dumps(
                [
                    {
                        **p.as_dict(),
                        "vllm": _vllms(h.config),
                        "checkpoints": _checkpoints(h.config),
                        "ledger": notes[h.name],
                    }
                    for p, h in zip(plans, hosts, strict=True)
                ],
                indent=2,
            )
        )
    else:
        print(
            "\n\n".join(
                planner.format_plan(p)
                + "".join(f"\n  {line}" for line in notes[h.name])
                + "".join(f"\n  vLLM of {name}: {line}" for name, line in _vllms(h.config).items())
                + "".join(f"\n  checkpoint of {name}: {line}" for name, line in _checkpoints(h.config).items())
                for p, h in zip(plans, hosts, strict=True)
            )
        )
    if needs := [problem for host in hosts for problem in host.needs]:
        print("\nWhat a deploy still needs (the plan does not; the deploy and every command that connects refuse):")
        print("\n".join(f"  - {problem}" for problem in needs))
    return 1 if unread else 0


def _planned_with_ledgers(
    hosts: list[Host], ledgers: dict[str, ledger_command.HostLedger]
) -> tuple[list[Host], dict[str, list[str]], bool]:
    """Each host with the newest matching ledger row as the figures of every engine that has no
    `measured` ones; the lines that say which row each took (or why none), and whether a host's
    ledger could not be read."""
    planned, notes, unread = [], {}, False
    for host in hosts:
        found = ledgers.get(host.name)
        if found is None or found.error:
            unread = True
            why = found.error if found else "not in the file"
            planned.append(host)
            notes[host.name] = [f"ledger of {host.name} not read ({why}): planned with the inventory's figures"]
            continue
        with_rows, used = ledger.with_ledger(host, found.rows)
        taken = {u.engine for u in used}
        lines = [u.line(host.name) for u in used]
        lines += [
            f"{e.name}: no row of the ledger matches its settings (checkpoint repo, window, KV dtype, KV bytes, "
            f"vLLM {host.config.pin(e).version})"
            for e in host.config.engines
            if e.name not in taken and not ledger.has_measured(e)
        ]
        lines += [f"ledger left out (untrusted): {line}" for line in found.untrusted]
        planned.append(with_rows)
        notes[host.name] = lines
    return planned, notes, unread


def _vllms(config: HostConfig) -> dict[str, str]:
    """Engine name -> the vLLM it runs and the lock its venv is built from, and whether that is the host's."""
    host, here = config.pin(), Path.cwd()
    lines = {}
    for engine in config.engines:
        pin = config.pin(engine)
        lock = Path(pin.lock)
        shown = lock.relative_to(here) if lock.is_relative_to(here) else lock
        whose = "the host's" if pin == host else f"its own; the host runs {host.requirement}"
        lines[engine.name] = f"{pin.requirement} from {shown} ({whose})"
    return lines


def _checkpoints(config: HostConfig) -> dict[str, str]:
    """Engine name -> what its checkpoint pins: the commit, or why it is not known yet."""
    lines = {}
    for engine in config.engines:
        checkpoint, commit = engine.checkpoint, config.commit(engine)
        if commit == checkpoint.revision:
            lines[engine.name] = f"{checkpoint.repo}@{commit}"
        elif commit:
            lines[engine.name] = (
                f"{checkpoint.repo} {checkpoint.revision} -> {commit} on the hub now "
                "(a host keeps the commit it recorded until the revision changes)"
            )
        else:
            lines[engine.name] = (
                f"{checkpoint.repo} {checkpoint.revision}: a branch or tag; the first deploy "
                "pins the commit it names on the host (--resolve asks the hub now)"
            )
    return lines


def add_parser(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser("plan", help="validate an inventory and print each host's memory plan")
    plan.add_argument("inventory", type=Path, nargs="?", help=INVENTORY_HELP)
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    plan.add_argument(
        "--resolve",
        action="store_true",
        help="ask the hub which commit each branch or tag names now (connects to hf_endpoint)",
    )
    measured = plan.add_mutually_exclusive_group()
    measured.add_argument(
        "--from-host",
        action="store_true",
        help="read each host's KV pool ledger over SSH: an engine without `measured` figures plans with the newest "
        "start whose settings match",
    )
    measured.add_argument(
        "--ledger", type=Path, metavar="FILE", help="the same, offline, from a file `sparkform ledger --json` wrote"
    )
    plan.set_defaults(run=run)
