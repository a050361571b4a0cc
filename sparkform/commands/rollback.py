"""`sparkform rollback INVENTORY [--engine NAME] [--host HOST]`: put engines back by hand on the
settings they last served with, for a change that starts but misbehaves.

Runs the host's own sparkform-rollback (sparkform/host/rollback.py) over SSH, the same
the deploy runs after a changed engine's failed start: it writes the kept files back, records
why (the next dry-run names the change while the inventory still renders it), alerts, and
restarts the engine to readiness. An engine that runs its last serving settings (the change
served, so the deploy kept it) goes back to the ones kept before them. Without --engine, every
engine of the host with settings to go back to goes back, one at a time in start order.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from sparkform.commands import ssh
from sparkform.commands.logs import engine_host
from sparkform.domain.layout import ROOT_PYTHON
from sparkform.domain.model import Host
from sparkform.domain.schema import HostConfig
from sparkform.rules import bootchain
from sparkform.rules.inventory import INVENTORY_HELP, load_inventory, raw_inventory
from sparkform.writers.programs import host_locked, run_by

EXIT_USAGE = 2
NOTHING_TO_GO_BACK_TO = 3  # sparkform-rollback's exit: nothing changed
# What the host's script records as the reason when the owner gives none.
BY_HAND = "rolled back by hand (sparkform rollback)"


def rollback_command(config: HostConfig, engine: str, reason: str) -> str:
    """The line run on the host: the reason on the script's stdin, never in its argv; the host
    lock held for it (a deploy or another rollback under way: it waits, then exit 4)."""
    run = shlex.join([*ROOT_PYTHON, config.paths.rollback, engine, "--by", "hand"])
    locked = host_locked(config, run_by(f"sparkform rollback of {engine}"), run)
    return f"printf '%s\\n' {shlex.quote(reason)} | {locked}"


def chosen(hosts: list[Host], engine: str | None, host: str | None) -> list[tuple[Host, list[str]]]:
    """(host, its engines to roll back, in start order); ValueError says why there is none."""
    if engine is not None:
        return [(engine_host(hosts, engine, host), [engine])]
    picked = [h for h in hosts if host is None or h.name == host]
    if not picked:
        raise ValueError(f"the inventory has no host {host!r} (hosts: {', '.join(h.name for h in hosts)})")
    return [(h, [e.name for e in bootchain.start_order(h.config)]) for h in picked]


def run(args: argparse.Namespace) -> int:
    """Exit code: 0 every engine named is back and serving (without --engine: those that had
    something to go back to); 1 a rollback failed or a host did not answer; 2 usage."""
    hosts = load_inventory(args.inventory)
    try:
        targets = chosen(hosts, args.engine, args.host)
    except ValueError as err:
        print(f"sparkform rollback: {err}", file=sys.stderr)
        return EXIT_USAGE
    raw = raw_inventory(args.inventory)
    failed = False
    with tempfile.TemporaryDirectory(prefix="sparkform-rollback-") as folder:
        for target, engines in targets:
            config = ssh.write_config(target.name, raw[target.name], Path(folder))
            for engine in engines:
                command = rollback_command(target.config, engine, args.reason or BY_HAND)
                timeout = target.config.host_lock_wait_s + target.config.timeout_start_s + 120
                try:
                    result = ssh.run(config, target.name, command, timeout=timeout)
                except subprocess.TimeoutExpired:
                    print(f"sparkform rollback: {target.name} {engine}: no answer in time", file=sys.stderr)
                    failed = True
                    continue
                sys.stdout.write(result.stdout)
                sys.stderr.write(result.stderr)
                if result.returncode == NOTHING_TO_GO_BACK_TO and args.engine is None:
                    continue  # that engine runs what it last served with
                if result.returncode:
                    print(f"sparkform rollback: {target.name} {engine}: exit {result.returncode}", file=sys.stderr)
                    failed = True
    return 1 if failed else 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    rollback = sub.add_parser("rollback", help="put engines back on the settings they last served with")
    rollback.add_argument("inventory", type=Path, nargs="?", help=INVENTORY_HELP)
    rollback.add_argument("--engine", help="only this engine (default: every engine with settings to go back to)")
    rollback.add_argument("--host", help="only this host (or the host of --engine, when several run one of that name)")
    rollback.add_argument("--reason", help="why, for the record, the alert and the next dry-run")
    rollback.set_defaults(run=run)
