"""`sparkform init [PATH]`: an inventory for the owner's own Spark, written from the shipped pair
(templates/inventory/spark.py.j2) with the host, the SSH user, the models and the ports given as
options and everything else the served pair's (docs/incidents.md#the-served-pair), comments kept.

Exit codes: 0 written, and what to do next printed; 2 the file exists (--force replaces it), or an
option of another shape; the written file is `sparkform plan`'s to check.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from sparkform.build.render import template
from sparkform.rules.inventory import DEFAULT_INVENTORY
from sparkform.spec import exits
from sparkform.spec.schema_sections import checked_address
from sparkform.spec.shapes import HOST_NAME, NAME_PATTERN

SHIPPED_FAST = ("nemotron", "nvidia/Nemotron-3.5-Lightning-30B-A3B-NVFP4", 8012)
SHIPPED_CAREFUL = ("q38", "RedHatAI/Qwen3.8-27B-NVFP4", 8011)
REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
USER = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
ENGINE_NAME = re.compile(NAME_PATTERN)


@dataclass(frozen=True)
class Role:
    name: str
    repo: str
    port: int

    @property
    def shipped(self) -> bool:
        """The served pair's own checkpoint: its flags, parsers and measured pool hold for it."""
        return self.repo in (SHIPPED_FAST[1], SHIPPED_CAREFUL[1])


def checked(value: str, pattern: re.Pattern, what: str) -> str:
    if not pattern.fullmatch(value):
        raise argparse.ArgumentTypeError(f"{value!r} is not {what}")
    return value


def address(value: str) -> str:
    try:
        return checked_address(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def run(args: argparse.Namespace) -> int:
    path = Path(args.path).expanduser()
    if path.exists() and not args.force:
        print(f"sparkform init: {path} exists: keep it, or write it anew with --force", file=sys.stderr)
        return exits.USAGE
    if args.fast_name == args.careful_name or args.fast_port == args.careful_port:
        print("sparkform init: the two engines need names and ports of their own", file=sys.stderr)
        return exits.USAGE
    fast = Role(args.fast_name, args.fast_model, args.fast_port)
    careful = Role(args.careful_name, args.careful_model, args.careful_port)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        template(
            "inventory/spark.py.j2",
            host=args.host,
            user=args.user,
            listen_address=args.listen_address,
            fast=fast,
            careful=careful,
            path=path,
        )
    )
    print(
        f"wrote {path}: {args.host} serving {fast.name} ({fast.repo}) on :{fast.port} and {careful.name} "
        f"({careful.repo}) on :{careful.port}, the front's combined port :8000\n"
        "next:\n"
        f"  sparkform plan {path}                 # the memory plan, and what a deploy still needs\n"
        "  mkdir -p ~/.config/sparkform && (umask 077; openssl rand -hex 32 > ~/.config/sparkform/spark-api-key)\n"
        f"  # record {args.host}'s SSH host key in ~/.config/sparkform/known_hosts (docs/security.md)\n"
        f'  pyinfra {path} "$(sparkform deploy-path)" --dry --diff\n'
        f"  export SPARKFORM_INVENTORY={path.resolve()}   # then every sparkform command finds it"
    )
    return exits.OK


def add_parser(sub: argparse._SubParsersAction) -> None:
    init = sub.add_parser("init", help="write an inventory for your own Spark from the shipped pair")
    init.add_argument("path", nargs="?", default=DEFAULT_INVENTORY, help=f"where (default {DEFAULT_INVENTORY})")
    init.add_argument(
        "--host", required=True, type=lambda v: checked(v, HOST_NAME, "a host name"), help="the Spark's name or address"
    )
    init.add_argument("--user", default="root", type=lambda v: checked(v, USER, "a user name"), help="the SSH user")
    init.add_argument(
        "--listen-address",
        default="0.0.0.0",
        type=address,
        help="where the front listens (default 0.0.0.0: the LAN, over TLS; 127.0.0.1 keeps the models on the box)",
    )
    for role, (name, repo, port) in (("fast", SHIPPED_FAST), ("careful", SHIPPED_CAREFUL)):
        init.add_argument(
            f"--{role}-name",
            default=name,
            type=lambda v: checked(v, ENGINE_NAME, "an engine name (a-z 0-9 -)"),
            help=f"the engine's name, and the model name clients ask for (default {name})",
        )
        init.add_argument(
            f"--{role}-model",
            default=repo,
            type=lambda v: checked(v, REPO_ID, "a Hugging Face repo id (org/name)"),
            help=f"the checkpoint's repo (default {repo})",
        )
        init.add_argument(f"--{role}-port", default=port, type=int, help=f"its port on the front (default {port})")
    init.add_argument("--force", action="store_true", help="replace an existing file")
    init.set_defaults(run=run)
