"""`sparkform render [INVENTORY] --out DIR [--host H] [--offline]`: every file a deploy writes, per
host, under DIR/HOST. A branch or tag is written as the commit the host recorded for it
(sparkform/commands/hostpins.py asks over SSH); --offline asks no host and writes it as named.

Exit codes: 0 written; 2 the inventory is invalid, or a host name would render outside --out.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from sparkform.commands import hostpins
from sparkform.domain.model import InventoryError, Problem
from sparkform.rules.inventory import INVENTORY_HELP, exit_invalid, load_inventory, raw_inventory
from sparkform.writers.render import render_host


def run(args: argparse.Namespace) -> int:
    """Every file a deploy writes, per host; a branch or tag as the commit the host recorded for it."""
    out = args.out.resolve()
    hosts, problems = [], []
    for host in load_inventory(args.inventory):
        if args.host and host.name != args.host:
            continue
        root = (out / host.name).resolve()
        if root == out or not root.is_relative_to(out):
            # A host name that climbs out (`..`) would write anywhere this user can.
            problems.append(
                Problem(
                    host.name,
                    "host name",
                    host.name,
                    f"renders into {root}, not inside --out {out}",
                    "name the host without '/' or '..'",
                )
            )
            continue
        hosts.append((root, host))
    if problems:
        exit_invalid(InventoryError(problems), str(args.inventory))
    planned, raw = [], {} if args.offline else raw_inventory(args.inventory)
    with tempfile.TemporaryDirectory(prefix="sparkform-render-") as folder:
        for root, host in hosts:
            config = host.config
            if hostpins.unpinned(config):  # a branch or tag: ask the host which commit it pinned
                answer = (
                    hostpins.Answer(why_not="not asked (--offline)")
                    if args.offline
                    else hostpins.ask(host.name, raw[host.name], config, Path(folder))
                )
                config = hostpins.pinned(config, answer)
                if line := hostpins.written_instead(host.name, config, answer):
                    print(line, file=sys.stderr)
            planned += [(root / file.path.lstrip("/"), file) for file in render_host(config, host.model_configs)]
    for target, file in planned:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(file.content)
        target.chmod(int(file.mode, 8))
        print(target)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    render = sub.add_parser("render", help="write every file a deploy would put on the hosts into a folder")
    render.add_argument("inventory", type=Path, nargs="?", help=INVENTORY_HELP)
    render.add_argument("--out", type=Path, required=True)
    render.add_argument("--host", help="only this host")
    render.add_argument(
        "--offline",
        action="store_true",
        help="ask no host which commit a branch or tag is pinned to (write it as named)",
    )
    render.set_defaults(run=run)
