"""`sparkform ledger INVENTORY [--host H] [--engine E] [--json]`: each host's KV pool ledger, read
over SSH (one round trip per host, hosts in parallel), every row checked before it is shown; and
the reading `sparkform plan --from-host` plans with.

Exit codes: 0 every host's ledger was read (an empty or missing one included); 1 a host did not
answer (named in one line); 2 the inventory is invalid or --host/--engine name nothing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkform.commands import ssh
from sparkform.domain.model import Host
from sparkform.reports.ledger import LedgerRow, format_ledger, read_command, read_rows
from sparkform.rules.inventory import INVENTORY_HELP, load_inventory, raw_inventory

SSH_TIMEOUT_S = 60.0


@dataclass
class HostLedger:
    """One host's ledger as read: its rows, the lines left out, or why it could not be read."""

    host: str
    rows: list[LedgerRow] = field(default_factory=list)
    untrusted: list[str] = field(default_factory=list)
    error: str | None = None

    def as_json(self) -> str:
        return json.dumps(
            {
                "host": self.host,
                "rows": [row.model_dump(mode="json") for row in self.rows],
                "untrusted": self.untrusted,
                "error": self.error,
            }
        )


def read_ledger(host: Host, data: dict[str, Any], folder: Path) -> HostLedger:
    """The host's ledger, or why it could not be read."""
    config = ssh.write_config(host.name, data, folder)
    try:
        result = ssh.run(config, host.name, read_command(host.config), timeout=SSH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return HostLedger(host.name, error=f"no answer over SSH within {SSH_TIMEOUT_S:.0f} s")
    if result.returncode != 0:
        return HostLedger(host.name, error=f"does not answer over SSH ({ssh.failure(result)})")
    untrusted: list[str] = []
    rows = read_rows(result.stdout.splitlines(), host.config.paths.kv_ledger, untrusted)
    return HostLedger(host.name, rows, untrusted)


def read_hosts(inventory: Path, hosts: list[Host]) -> list[HostLedger]:
    raw = raw_inventory(inventory)
    with tempfile.TemporaryDirectory(prefix="sparkform-ledger-") as folder:
        return ssh.each_host(lambda h: read_ledger(h, raw[h.name], Path(folder)), hosts)


def load_file(path: Path) -> dict[str, HostLedger]:
    """Host -> its ledger, from a file `sparkform ledger --json` wrote; every row is checked again
    (ValueError: a line that is not such an object)."""
    ledgers = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            host, rows = entry["host"], entry["rows"]
            if not isinstance(host, str) or not isinstance(rows, list):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            raise ValueError(
                f"{path} line {number} is not a host's ledger as `sparkform ledger --json` prints it"
            ) from None
        untrusted: list[str] = []
        checked = read_rows([json.dumps(row) for row in rows], f"{path} line {number}", untrusted)
        ledgers[host] = HostLedger(host, checked, untrusted)
    return ledgers


def run(args: argparse.Namespace) -> int:
    hosts = [h for h in load_inventory(args.inventory) if args.host in (None, h.name)]
    if not hosts:
        print(f"sparkform ledger: {args.inventory} has no host {args.host!r}", file=sys.stderr)
        return 2
    if args.engine is not None:
        hosts = [h for h in hosts if args.engine in {e.name for e in h.config.engines}]
        if not hosts:
            print(f"sparkform ledger: no host of {args.inventory} runs an engine {args.engine!r}", file=sys.stderr)
            return 2
    ledgers = read_hosts(args.inventory, hosts)
    for ledger in ledgers:
        if args.engine is not None:
            ledger.rows = [row for row in ledger.rows if row.engine == args.engine]
        if args.json:
            print(ledger.as_json())
        elif ledger.error:
            print(f"host {ledger.host}: {ledger.error}")
        else:
            print(format_ledger(ledger.host, ledger.rows, ledger.untrusted))
    return 1 if any(ledger.error for ledger in ledgers) else 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    ledger = sub.add_parser(
        "ledger", help="each host's KV pool ledger: every start's pool as vLLM printed it, beside the plan's"
    )
    ledger.add_argument("inventory", type=Path, nargs="?", help=INVENTORY_HELP)
    ledger.add_argument("--host", help="only this host")
    ledger.add_argument("--engine", help="only this engine's rows")
    ledger.add_argument(
        "--json", action="store_true", help="one JSON object per host and line (what plan --ledger reads)"
    )
    ledger.set_defaults(run=run)
