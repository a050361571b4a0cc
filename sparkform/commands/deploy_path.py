"""`sparkform deploy-path`: where the deploy file pyinfra runs is, for
`pyinfra INVENTORY "$(sparkform deploy-path)"`.

Exit code: 0.
"""

from __future__ import annotations

import argparse

from sparkform.domain.package_data import DEPLOY


def run(_: argparse.Namespace) -> int:
    """Where deploy.py is: in the checkout, or in the installed wheel (package data: domain/package_data.py)."""
    print(DEPLOY)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    deploy_path = sub.add_parser(
        "deploy-path", help='print where deploy.py is: pyinfra INVENTORY "$(sparkform deploy-path)"'
    )
    deploy_path.set_defaults(run=run)
