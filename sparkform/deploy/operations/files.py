"""Files rendered from templates/ (units, scripts, settings) and secrets, put only when they differ."""

from __future__ import annotations

import shlex
from io import StringIO

from pyinfra import host, logger, state
from pyinfra.api import FileUploadCommand, operation
from pyinfra.facts.files import FileContents
from pyinfra.operations.util.files import generate_color_diff

from sparkform.readers.snapshot import RemoteFile
from sparkform.writers.converge import differs


def replaced_file(path: str, line: str, mode: str = "644") -> str:
    """A command that makes `path` (in a root-only folder) hold `line` with `mode`, by a new temp
    file and a rename: never through a link planted at either name (mktemp creates its file
    exclusively; a rename replaces a link, not what it points at)."""
    target = shlex.quote(path)
    return (
        f"temp=$(mktemp {target}.XXXXXX) && printf '%s\\n' {shlex.quote(line)} > \"$temp\" "
        f'&& chmod {mode} "$temp" && mv -fT "$temp" {target}'
    )


@operation()
def managed_file(
    path: str,
    content: str,
    mode: str,
    current: RemoteFile | None,
    user: str = "root",
    group: str = "root",
    secret: bool = False,
):
    """
    Put `content` at `path` when the host's copy differs; with --diff show what changes.

    + path: file on the host
    + content: the text the file must hold
    + mode: octal mode, e.g. "644"
    + current: the host's copy (from the HostSnapshot fact), None when absent
    + user: owner
    + group: group
    + secret: never print the content; upload through a temporary file in the same
      (private) folder, so the secret is never readable in /tmp
    """
    quoted = shlex.quote(path)
    if differs(content, current):
        if state.config.DIFF:
            _log_diff(path, content, current, secret)
        folder = path.rsplit("/", 1)[0]
        temp = host.get_temp_filename(path, temp_directory=folder if secret else None)
        yield FileUploadCommand(StringIO(content), path, remote_temp_filename=temp)
        yield f"chown {shlex.quote(f'{user}:{group}')} {quoted}"
        yield f"chmod {mode} {quoted}"
        return
    assert current is not None, "differs() holds for a file the host does not have"
    if current.mode != mode:
        yield f"chmod {mode} {quoted}"
    if (current.user, current.group) != (user, group):
        yield f"chown {shlex.quote(f'{user}:{group}')} {quoted}"
    if (current.mode, current.user, current.group) == (mode, user, group):
        host.noop(f"{path} is up to date")


def _log_diff(path: str, content: str, current: RemoteFile | None, secret: bool) -> None:
    host.log(f"Will {'modify' if current else 'create'} {path}", logger.info)
    if secret:
        logger.info("  (secret: contents not shown)")
        return
    old = host.get_fact(FileContents, path=path) if current else None
    old_lines = [line + "\n" for line in old or []]
    for line in generate_color_diff(old_lines, content.splitlines(keepends=True)):
        logger.info("  %s", line)
    logger.info("")


@operation()
def removed(path: str, current: RemoteFile | None):
    """
    Remove a file (or a symlink, not what it points at).

    + path: file on the host
    + current: the host's copy from the HostSnapshot fact, None when absent
    """
    if current is None:
        host.noop(f"{path} is absent")
        return
    yield f"rm -f {shlex.quote(path)}"
