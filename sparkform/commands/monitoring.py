"""`sparkform monitoring [INVENTORY] --out DIR`: a Prometheus scrape config, alert rules and a
Grafana dashboard for the hosts (sparkform/writers/monitoring.py writes them); it never connects.

Exit codes: 0 written; 2 the inventory is invalid.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sparkform.rules.inventory import INVENTORY_HELP, load_inventory, raw_inventory
from sparkform.writers import monitoring


def run(args: argparse.Namespace) -> int:
    addresses = {name: data.get("ssh_hostname") for name, data in raw_inventory(args.inventory).items()}
    for path in monitoring.write(load_inventory(args.inventory), addresses, str(args.inventory), args.out):
        print(path)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    watch = sub.add_parser(
        "monitoring", help="write a Prometheus scrape config, alert rules and a Grafana dashboard for the hosts"
    )
    watch.add_argument("inventory", type=Path, nargs="?", help=INVENTORY_HELP)
    watch.add_argument("--out", type=Path, required=True)
    watch.set_defaults(run=run)
