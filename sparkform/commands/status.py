"""`sparkform status INVENTORY [--json] [--watch N]`: each host read in one SSH round trip, all
hosts at once.

Exit codes: 0 every enabled engine of every host serves, through its front, and the guard runs;
1 one of those does not hold, or a host did not answer (named in one line each); 2 the
inventory is invalid.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sparkform.commands import ssh
from sparkform.domain.model import Host
from sparkform.reports.status import read_status, status_command, unreachable
from sparkform.reports.status_schema import HostStatus
from sparkform.reports.status_table import format_status
from sparkform.rules.inventory import INVENTORY_HELP, load_inventory, raw_inventory

SSH_TIMEOUT_S = 60.0
CLEAR_SCREEN = "\033[H\033[2J"


def read_host(host: Host, data: dict[str, Any], folder: Path, sample_s: float) -> HostStatus:
    """The host's status, or why it could not be read."""
    config = ssh.write_config(host.name, data, folder)
    # The first client's key goes on stdin, for the keyed request through the front (validation read the file).
    files = list(host.config.client_key_files.values())
    key = Path(files[0]).expanduser().read_text().strip() if files else ""
    try:
        result = ssh.run(
            config, host.name, status_command(host.config, sample_s), timeout=SSH_TIMEOUT_S + sample_s, stdin=key + "\n"
        )
    except subprocess.TimeoutExpired:
        return unreachable(host.name, f"no answer over SSH within {SSH_TIMEOUT_S + sample_s:.0f} s")
    if result.returncode != 0:  # the command itself always exits 0: this is ssh's 255
        return unreachable(host.name, f"does not answer over SSH ({ssh.failure(result)})")
    return read_status(host.name, host.config, result.stdout.splitlines())


def run(args: argparse.Namespace) -> int:
    if args.schema:
        print(json.dumps(HostStatus.model_json_schema(), indent=2))
        return 0
    hosts = [h for h in load_inventory(args.inventory) if args.host in (None, h.name)]
    if not hosts:
        print(f"sparkform status: {args.inventory} has no host {args.host!r}", file=sys.stderr)
        return 2
    raw = raw_inventory(args.inventory)
    with tempfile.TemporaryDirectory(prefix="sparkform-status-") as folder:
        while True:
            statuses = ssh.each_host(lambda h: read_host(h, raw[h.name], Path(folder), args.sample), hosts)
            if args.json:
                print("\n".join(s.model_dump_json() for s in statuses), flush=True)
            else:
                screen = CLEAR_SCREEN if args.watch and sys.stdout.isatty() else ""
                print(screen + "\n\n".join(format_status(s, args.wide) for s in statuses), flush=True)
            code = 0 if all(s.serving and not s.problems for s in statuses) else 1
            if not args.watch:
                return code
            if not args.json:
                print()
            time.sleep(args.watch)


def positive_seconds(text: str) -> float:
    """An argparse type: seconds, a finite number above 0."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number of seconds")
    return seconds


def add_parser(sub: argparse._SubParsersAction) -> None:
    status = sub.add_parser("status", help="each host's engines, memory and GPU at a glance (one SSH round trip)")
    status.add_argument("inventory", type=Path, nargs="?", help=INVENTORY_HELP)
    status.add_argument("--json", action="store_true", help="one JSON object per host and line (docs/status.md)")
    status.add_argument("--watch", type=positive_seconds, metavar="N", help="read again every N seconds until Ctrl-C")
    status.add_argument("--host", help="only this host")
    status.add_argument("--wide", action="store_true", help="every column, lines unwrapped (default: 100 columns)")
    status.add_argument(
        "--sample",
        type=positive_seconds,
        default=2.0,
        help="seconds between the two /metrics reads that give tok/s (default 2)",
    )
    status.add_argument("--schema", action="store_true", help="print the JSON Schema of --json's objects and exit")
    status.set_defaults(run=run)
