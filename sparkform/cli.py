"""`sparkform`: plan, render, verify, show the status and the logs of hosts; lock vLLM; run the local sandbox.

Each command is a module of its own under sparkform/commands/ (the sandbox's: sparkform/sandbox/command.py)
with its `add_parser` and its `run`; this module builds the command line from them and turns what a
command raises into one line and an exit code.
`plan` (unless --resolve or --from-host), `fields`, `deploy-path` and `render --offline` never connect
(`render` asks each host which commit its branches and tags are pinned to); `verify`, `rebuild`,
`status`, `ledger`, `logs`, `rollback`, `contract` and `bench` validate the inventory before they
connect; `lock` asks the package indexes.
Exit codes: the table of sparkform/domain/exits.py, for every command (`sparkform --help` prints it).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shlex
import sys
import textwrap

from sparkform.commands import (
    bench,
    cert,
    contract,
    deploy_path,
    fields,
    init,
    ledger,
    lock,
    logs,
    monitoring,
    plan,
    rebuild,
    render,
    rollback,
    status,
    verify,
)
from sparkform.domain import exits
from sparkform.domain.exits import EXIT_CODES
from sparkform.domain.model import InventoryError
from sparkform.rules.inventory import UnloadableInventory, default_inventory, exit_invalid
from sparkform.sandbox import command as sandbox

# The commands, in the order `sparkform --help` lists them.
COMMANDS = (
    init,
    plan,
    render,
    verify,
    sandbox,
    logs,
    status,
    cert,
    contract,
    ledger,
    rollback,
    bench,
    rebuild,
    deploy_path,
    monitoring,
    fields,
    lock,
)


def parser() -> argparse.ArgumentParser:
    """The command line: the global options, and each command's own from its module."""
    top = argparse.ArgumentParser(
        prog="sparkform",
        description=__doc__.splitlines()[0],
        epilog="exit codes, every command:\n"
        + "\n".join(f"  {code:>3}  {textwrap.fill(text, 90, subsequent_indent=' ' * 7)}" for code, text in EXIT_CODES),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    top.add_argument("--version", action="version", version=f"sparkform {importlib.metadata.version('sparkform')}")
    sub = top.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return top


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if getattr(args, "inventory", False) is None:
        args.inventory = default_inventory()
    args.command_line = shlex.join(["sparkform", *argv])  # what `lock` writes into the lock's header
    try:
        return args.run(args)
    except BrokenPipeError:
        # The reader left (`sparkform plan ... | head -1`): success, whether it left before the
        # last write or after (so a `set -o pipefail` script sees one code), no traceback, and
        # none at exit when Python flushes stdout into the closed pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return exits.OK
    except KeyboardInterrupt:
        print(file=sys.stderr)  # past the ^C the terminal echoed
        return exits.INTERRUPTED
    except UnloadableInventory as err:
        print(f"sparkform: {err}", file=sys.stderr)
        return exits.USAGE
    except InventoryError as err:
        exit_invalid(err, str(args.inventory))
    except (FileNotFoundError, IsADirectoryError) as err:
        print(f"sparkform: {err}", file=sys.stderr)
        return exits.FAILED


if __name__ == "__main__":
    sys.exit(main())
