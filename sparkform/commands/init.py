"""`sparkform init [PATH]`: an inventory for the owner's own Spark, written from the shipped one
(inventory/spark.py). The names of its block marked `sparkform init` take the options' values (the
host, the SSH user, where the front listens, the models and the ports), each written as a literal;
everything else is the served pair's (docs/incidents.md#the-served-pair), comments kept. The copy
has a docstring of its own, serves the pair alone and reads no environment variable.

Exit codes: 0 written, and what to do next printed; 2 the file exists (--force replaces it), or an
option of another shape; the written file is `sparkform plan`'s to check.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from sparkform.domain import exits
from sparkform.domain.package_data import INVENTORIES
from sparkform.domain.schema_sections import checked_address
from sparkform.domain.shapes import HOST_NAME, NAME_PATTERN
from sparkform.rules.inventory import DEFAULT_INVENTORY

SHIPPED = INVENTORIES / "spark.py"
BLOCK_BEGIN, BLOCK_END = "# >>> sparkform init", "# <<< sparkform init"
# Each option and the name of the block it sets; EMBEDDING is init's own: the copy serves the pair alone.
NAMES = {
    "host": "HOST",
    "user": "SSH_USER",
    "listen_address": "LISTEN_ADDRESS",
    "fast_name": "FAST_NAME",
    "fast_model": "FAST_MODEL",
    "fast_port": "FAST_PORT",
    "careful_name": "CAREFUL_NAME",
    "careful_model": "CAREFUL_MODEL",
    "careful_port": "CAREFUL_PORT",
}
PAIR_ALONE = {"EMBEDDING": False}
REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
USER = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
ENGINE_NAME = re.compile(NAME_PATTERN)
# The copy's docstring; the path is escaped for the triple quotes it stands in.
DOCSTRING = '''"""{host}: a DGX Spark serving two engines at once, {careful} started after {fast} is ready.
Written by `sparkform init` from the shipped pair (docs/incidents.md#the-served-pair); edit it
freely: every field is in docs/fields.md, and `sparkform plan` checks it without connecting.

    sparkform plan {path}                           # memory plan, no connection
    pyinfra {path} "$(sparkform deploy-path)" --dry --diff   # look first
    pyinfra {path} "$(sparkform deploy-path)"                # converge

The pair serves the LAN, so the front asks every client for a key (docs/security.md) and speaks
HTTPS with a certificate the deploy makes once (docs/clients.md, TLS). Before the first deploy:

    mkdir -p ~/.config/sparkform && (umask 077; openssl rand -hex 32 > ~/.config/sparkform/spark-api-key)

and record the Spark's SSH host key in ~/.config/sparkform/known_hosts, as docs/security.md
("Pinned host keys") says.
"""'''


@dataclass(frozen=True)
class Setting:
    """A name the init block assigns: its value in a copy unless an option gives one (the literal,
    or the default of the os.environ.get it reads), and where that value lies in the block."""

    default: object
    start: int
    end: int


def _line_starts(text: str) -> list[int]:
    """Where each line of `text` starts, and past its end, as Python numbers lines (str.splitlines
    would break at a form feed too)."""
    return [0, *(match.end() for match in re.finditer("\n", text)), len(text)]


def _block(source: str) -> tuple[int, int]:
    """Where the init block of `source` lies: the offsets of its first line and past its last
    (the markers left out); ValueError when it is not marked once."""
    lines, starts = source.split("\n"), _line_starts(source)
    begins = [n for n, line in enumerate(lines) if line.startswith(BLOCK_BEGIN)]
    ends = [n for n, line in enumerate(lines) if line.startswith(BLOCK_END)]
    if len(begins) != 1 or len(ends) != 1 or ends[0] < begins[0]:
        raise ValueError(f"{SHIPPED}: mark one block with {BLOCK_BEGIN!r} and {BLOCK_END!r}")
    return starts[begins[0] + 1], starts[ends[0]]


def _default(value: ast.expr) -> object:
    """The value a copy gets for `value`: a literal itself, or the default of os.environ.get."""
    if (
        isinstance(value, ast.Call)
        and ast.unparse(value.func) == "os.environ.get"
        and 1 <= len(value.args) <= 2
        and not value.keywords
    ):
        return ast.literal_eval(value.args[1]) if len(value.args) == 2 else None
    return ast.literal_eval(value)


def settings(block: str) -> dict[str, Setting]:
    """Each name the init block assigns; ValueError for a line of another shape than
    `NAME = literal` or `NAME = os.environ.get("VARIABLE", literal)`."""
    lines, starts = block.split("\n"), _line_starts(block)

    def offset(lineno: int, byte: int) -> int:  # ast counts columns in UTF-8 bytes
        return starts[lineno - 1] + len(lines[lineno - 1].encode()[:byte].decode())

    found: dict[str, Setting] = {}
    for statement in ast.parse(block).body:
        try:
            if not (
                isinstance(statement, ast.Assign)
                and len(statement.targets) == 1
                and isinstance(statement.targets[0], ast.Name)
            ):
                raise ValueError
            default = _default(statement.value)
        except (ValueError, TypeError):
            raise ValueError(
                f"{SHIPPED}: the block marked {BLOCK_BEGIN!r} assigns each name a literal or os.environ.get(...) "
                f"with a literal default, not {ast.unparse(statement)!r}"
            ) from None
        value = statement.value
        found[statement.targets[0].id] = Setting(
            default,
            offset(value.lineno, value.col_offset),
            offset(value.end_lineno or value.lineno, value.end_col_offset or 0),
        )
    return found


def shipped_defaults() -> dict[str, object]:
    """The value of each name of the shipped inventory's init block, as a copy gets it unless told."""
    source = SHIPPED.read_text()
    start, end = _block(source)
    return {name: setting.default for name, setting in settings(source[start:end]).items()}


def literal(value: object) -> str:
    """`value` as a Python literal, a text in the file's double quotes where it holds no quote."""
    text = repr(value)
    if isinstance(value, str) and not {'"', "'"} & set(value):
        return f'"{text[1:-1]}"'
    return text


def _lines(source: str, node: ast.stmt) -> tuple[int, int]:
    """The offsets of the whole lines `node` takes in `source`."""
    starts = _line_starts(source)
    return starts[node.lineno - 1], starts[node.end_lineno or node.lineno]


def written(source: str, values: dict[str, object], docstring: str) -> str:
    """The inventory `source` with `values` for names of its init block (the rest as it defaults
    them), each as a literal; `docstring` for its own, and without `import os` once nothing reads it."""
    start, end = _block(source)
    block, found = source[start:end], settings(source[start:end])
    if unknown := sorted(values.keys() - found.keys()):
        raise ValueError(f"{SHIPPED}: the block marked {BLOCK_BEGIN!r} assigns no {', '.join(unknown)}")
    for name, setting in sorted(found.items(), key=lambda item: item[1].start, reverse=True):
        block = block[: setting.start] + literal(values.get(name, setting.default)) + block[setting.end :]
    text = source[:start] + block + source[end:]
    tree = ast.parse(text)
    edits = []  # (start, end, replacement), applied from the last one up
    first = tree.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        line_start, line_end = _lines(text, first)
        edits.append((line_start, line_end, docstring + "\n"))
    reads_os = any(isinstance(node, ast.Name) and node.id == "os" for node in ast.walk(tree))
    for statement in tree.body:
        if isinstance(statement, ast.Import) and [a.name for a in statement.names] == ["os"] and not reads_os:
            line_start, line_end = _lines(text, statement)
            edits.append((line_start, line_end + (text[line_end : line_end + 1] == "\n"), ""))
    for edit_start, edit_end, replacement in sorted(edits, reverse=True):
        text = text[:edit_start] + replacement + text[edit_end:]
    return text


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
    values = {name: getattr(args, option) for option, name in NAMES.items()} | PAIR_ALONE
    shown = str(path).replace("\\", "\\\\").replace('"', '\\"')
    docstring = DOCSTRING.format(host=args.host, fast=args.fast_name, careful=args.careful_name, path=shown)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(written(SHIPPED.read_text(), values, docstring))
    print(
        f"wrote {path}: {args.host} serving {args.fast_name} ({args.fast_model}) on :{args.fast_port} and "
        f"{args.careful_name} ({args.careful_model}) on :{args.careful_port}, the front's combined port :8000\n"
        "next:\n"
        f"  sparkform plan {path}                 # the memory plan, and what a deploy still needs\n"
        "  mkdir -p ~/.config/sparkform && (umask 077; openssl rand -hex 32 > ~/.config/sparkform/spark-api-key)\n"
        f"  # record {args.host}'s SSH host key in ~/.config/sparkform/known_hosts (docs/security.md)\n"
        f'  pyinfra {path} "$(sparkform deploy-path)" --dry --diff\n'
        f"  export SPARKFORM_INVENTORY={path.resolve()}   # then every sparkform command finds it"
    )
    return exits.OK


def add_parser(sub: argparse._SubParsersAction) -> None:
    shipped = shipped_defaults()
    init = sub.add_parser("init", help="write an inventory for your own Spark from the shipped pair")
    init.add_argument("path", nargs="?", default=DEFAULT_INVENTORY, help=f"where (default {DEFAULT_INVENTORY})")
    init.add_argument(
        "--host", required=True, type=lambda v: checked(v, HOST_NAME, "a host name"), help="the Spark's name or address"
    )
    init.add_argument(
        "--user", default=shipped["SSH_USER"], type=lambda v: checked(v, USER, "a user name"), help="the SSH user"
    )
    init.add_argument(
        "--listen-address",
        default=shipped["LISTEN_ADDRESS"],
        type=address,
        help=f"where the front listens (default {shipped['LISTEN_ADDRESS']}: the LAN, over TLS; 127.0.0.1 keeps the "
        "models on the box)",
    )
    for role in ("fast", "careful"):
        name, repo, port = (shipped[f"{role.upper()}_{what}"] for what in ("NAME", "MODEL", "PORT"))
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
