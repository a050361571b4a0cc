"""`sparkform cert INVENTORY [--host H]`: the certificate the host's front serves over TLS, read
over the inventory's SSH (its pinned host key vouches for it), as PEM on stdout for clients to
trust; its SHA-256 fingerprint on stderr, to compare with the one the deploy printed.

Exit codes: 0 the certificate was printed; 1 the host did not answer, or has no certificate (no
converge with TLS on yet), or one of another shape; 2 the inventory is invalid, --host names no
host, or the host's front does not speak TLS.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from sparkform.commands import ssh
from sparkform.rules.front_tls import fingerprint, read_back, read_command
from sparkform.rules.inventory import INVENTORY_HELP, load_inventory, raw_inventory

SSH_TIMEOUT_S = 60.0


def run(args: argparse.Namespace) -> int:
    hosts = [h for h in load_inventory(args.inventory) if args.host in (None, h.name)]
    if len(hosts) != 1:
        named = ", ".join(h.name for h in load_inventory(args.inventory))
        print(f"sparkform cert: name one host of {args.inventory} with --host (it has: {named})", file=sys.stderr)
        return 2
    host = hosts[0]
    if not host.config.front_tls_on:
        print(
            f"sparkform cert: {host.name}'s front speaks plain HTTP (front_tls.enabled, listen_address "
            f"{host.config.listen_address}): there is no certificate to trust",
            file=sys.stderr,
        )
        return 2
    path = host.config.paths.front_certificate
    with tempfile.TemporaryDirectory(prefix="sparkform-cert-") as folder:
        config = ssh.write_config(host.name, raw_inventory(args.inventory)[host.name], Path(folder))
        try:
            result = ssh.run(config, host.name, read_command(path), SSH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print(f"sparkform cert: {host.name}: no answer over SSH within {SSH_TIMEOUT_S:.0f} s", file=sys.stderr)
            return 1
    if result.returncode == 255:
        print(f"sparkform cert: {host.name} does not answer over SSH ({ssh.failure(result)})", file=sys.stderr)
        return 1
    # A link at the path is named (never followed), and is no certificate either.
    pem = read_back(result.stdout.splitlines(), path, [])
    if pem is None:
        print(
            f"sparkform cert: {host.name} has no certificate of sparkform's shape at {path}: converge it with "
            "TLS on first (pyinfra INVENTORY deploy.py)",
            file=sys.stderr,
        )
        return 1
    sys.stdout.write(pem)
    print(f"{host.name}: SHA-256 fingerprint {fingerprint(pem)}", file=sys.stderr)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    cert = sub.add_parser(
        "cert", help="print the certificate a host's front serves over TLS (PEM), for clients to trust"
    )
    cert.add_argument("inventory", type=Path, nargs="?", help=INVENTORY_HELP)
    cert.add_argument("--host", help="the host (needed when the inventory has several)")
    cert.set_defaults(run=run)
