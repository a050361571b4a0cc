"""`sparkform verify [INVENTORY] [--deep] [-- PYTEST_ARGS]`: the testinfra suite (sparkform/verify)
against every host of the inventory, over SSH, once each host answers.

Exit codes: pytest's; 1 a host does not answer over SSH (one line each, before any test); 2 the
inventory is invalid.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from sparkform.commands import ssh
from sparkform.domain.model import Host
from sparkform.domain.package_data import VERIFY_SUITE
from sparkform.rules.inventory import INVENTORY_HELP, load_inventory, raw_inventory


def _unreachable(inventory: Path, hosts: list[Host]) -> list[str]:
    """One line for each host that does not answer over SSH now (the reason is ssh's last line)."""
    raw = raw_inventory(inventory)
    lines = []
    with tempfile.TemporaryDirectory(prefix="sparkform-reach-") as folder:
        for h in hosts:
            reason = ssh.unreachable(ssh.write_config(h.name, raw[h.name], Path(folder)), h.name)
            if reason is not None:
                lines.append(f"sparkform verify: {h.name} does not answer over SSH ({reason}); nothing was checked")
    return lines


def run(args: argparse.Namespace) -> int:
    """Run the testinfra suite against every host of the inventory (exit code: pytest's; 1 when a
    host does not answer over SSH, in one line, before any test)."""
    hosts = load_inventory(args.inventory)  # a broken inventory stops here, before any connection
    unreachable = _unreachable(args.inventory, hosts)
    if unreachable:
        print("\n".join(unreachable), file=sys.stderr)
        return 1
    import pytest

    options = [
        str(VERIFY_SUITE),
        f"--inventory={args.inventory.resolve()}",
        "-p",
        "no:cacheprovider",
        # anyio (a plugin of pytest's, installed with the SDKs) is imported before pytest starts
        # here, and pytest would warn on every run that it cannot rewrite it: the suite uses none of it.
        "-W",
        "ignore:Module already imported so cannot be rewritten; anyio:pytest.PytestAssertRewriteWarning",
        f"--rootdir={VERIFY_SUITE}",
        "-q",
        *(["--deep"] if args.deep else []),
        *args.pytest_args,
    ]
    return int(pytest.main(options))


def add_parser(sub: argparse._SubParsersAction) -> None:
    verify = sub.add_parser("verify", help="check converged hosts over SSH (testinfra suite sparkform/verify)")
    verify.add_argument("inventory", type=Path, nargs="?", help=INVENTORY_HELP)
    verify.add_argument("--deep", action="store_true", help="also re-hash every checkpoint file against its manifest")
    verify.add_argument("pytest_args", nargs="*", help="further pytest arguments (after --)")
    verify.set_defaults(run=run)
