"""Reading back the one-line files sparkform writes on a host (pins, cache keys, stamps), trusting
only what has the shape sparkform writes it in.

remote.plain_files prints `path:line` for each plain file (a symbolic link is named, never
followed); `named_lines` keeps a file's line only when its name and its line have their shapes,
and lists everything else as untrusted. The deploy's snapshot fact (sparkform/deploy/facts/snapshot.py) reads them
in its round trip; `sparkform render` asks a host for its pins (hostpins.py).
"""

from __future__ import annotations

import re
import shlex

from sparkform.domain.shapes import COMMIT_ID
from sparkform.readers.remote import plain_files

# A pin (owner--name@revision) and a checkpoint folder (owner--name@commit) share one shape.
REPO_AT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*@[A-Za-z0-9][A-Za-z0-9._-]*")

Shape = tuple[re.Pattern, str]  # the pattern, and what a value of that shape is


def shaped(shape: Shape, value: str, where: str, untrusted: list[str]) -> bool:
    """Whether `value` (read from `where`) has the shape; if not, why, appended to `untrusted`."""
    if shape[0].fullmatch(value):
        return True
    untrusted.append(f"{where} holds {value!r}, which is not {shape[1]}")
    return False


def named_lines(lines: list[str], name_shape: Shape, value_shape: Shape, untrusted: list[str]) -> dict[str, str]:
    """File name -> its one line, for the `path:line` lines whose name and line both have their shape."""
    found = {}
    for line in lines:
        path, _, value = line.partition(":")
        name = path.rsplit("/", 1)[-1]
        if shaped(name_shape, name, path, untrusted) and shaped(value_shape, value, path, untrusted):
            found[name] = value
    return found


def pins_command(pins_dir: str) -> str:
    """The shell that prints the host's pins (`<pins_dir>/<owner>--<name>@<revision>`, one commit each)."""
    return plain_files(f"{shlex.quote(pins_dir)}/*")


def pins(lines: list[str], untrusted: list[str]) -> dict[str, str]:
    """Pin name (repo@revision) -> the commit the host recorded, from pins_command's lines."""
    return named_lines(lines, (REPO_AT, "a pin name (repo@revision)"), (COMMIT_ID, "a commit id"), untrusted)
