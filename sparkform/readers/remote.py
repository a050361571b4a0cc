"""Shell snippets that read a host in one SSH round trip, and the splitting of what they print.

A reader (the deploy's snapshot fact, `sparkform status`) joins sections: each prints a marker
line, then its probe's output; a probe that fails prints nothing and never stops the others.
"""

from __future__ import annotations

import shlex

SECTION = "@@sparkform:"
LINK = "@@link:"  # a symbolic link where sparkform reads back a file


def section(name: str, command: str) -> str:
    """`command`'s output under the marker of `name`; its errors and exit code are dropped."""
    return f"echo {SECTION}{name}; {{ {command} ; }} 2>/dev/null || true"


def plain_files(words: str) -> str:
    """Print `path:line` for each line of each plain file among `words` (quoted paths or a glob);
    a symbolic link is named after LINK, never followed (it could point at a secret)."""
    return (
        f'for f in {words}; do if [ -L "$f" ]; then echo "{LINK}$f"; elif [ -f "$f" ]; then grep -H . -- "$f"; fi; done'
    )


def plain_file(path: str) -> str:
    """Print the file at `path` when it is a plain file; a symbolic link is named after LINK."""
    quoted = shlex.quote(path)
    return f"if [ -L {quoted} ]; then echo {LINK}{quoted}; else cat {quoted}; fi"


def split_sections(lines: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """(section name -> its lines, the symbolic links found where a plain file was read)."""
    sections: dict[str, list[str]] = {}
    links: list[str] = []
    current: list[str] = []
    for line in lines:
        if line.startswith(SECTION):
            current = sections.setdefault(line[len(SECTION) :], [])
        elif line.startswith(LINK):
            links.append(line[len(LINK) :])
        else:
            current.append(line)
    return sections, links
