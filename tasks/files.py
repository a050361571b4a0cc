"""Files rendered from templates/ (units, scripts, settings) and secrets, put only when they differ."""

from __future__ import annotations

import hashlib
import shlex
from dataclasses import dataclass
from io import StringIO
from pathlib import Path

from pyinfra import host, logger, state
from pyinfra.api import FileUploadCommand, operation
from pyinfra.operations.util.files import generate_color_diff
from pyinfra.facts.files import FileContents

from facts.host import RemoteFile
from sparkform.hostrecord import record_dir
from sparkform.render import NGINX_DEFAULT_SITE
from sparkform.schema import HostConfig


def sha256(content: str) -> str:
    return hashlib.sha256(content.encode()).hexdigest()


def applied_stamp(config: HostConfig, service: str) -> str:
    """Root's record of the inputs `service` last (re)started or reloaded with: a run cut off
    between writing a file and the reload leaves it stale, so the next run still reloads."""
    return f"{record_dir(config.state_dir)}/applied-{service}"


def replaced_file(path: str, line: str) -> str:
    """A command that makes `path` (in a root-only folder) hold `line`, by a new temp file and a
    rename: never through a link planted at either name (mktemp creates its file exclusively;
    a rename replaces a link, not what it points at)."""
    target = shlex.quote(path)
    return (f"temp=$(mktemp {target}.XXXXXX) && printf '%s\\n' {shlex.quote(line)} > \"$temp\" "
            f"&& chmod 644 \"$temp\" && mv -fT \"$temp\" {target}")


def digest(*contents: str) -> str:
    return sha256("\0".join(contents))[:32]


def differs(content: str, current: RemoteFile | None) -> bool:
    """Whether the host's copy (None: absent) holds something else than `content`."""
    return current is None or current.sha256 != sha256(content)


@operation()
def managed_file(path: str, content: str, mode: str, current: RemoteFile | None,
                 user: str = "root", group: str = "root", secret: bool = False):
    """
    Put `content` at `path` when the host's copy differs; with --diff show what changes.

    + path: file on the host
    + content: the text the file must hold
    + mode: octal mode, e.g. "644"
    + current: the host's copy (from the SparkformHost fact), None when absent
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


@dataclass(frozen=True)
class Secret:
    path: str
    content: str
    mode: str
    group: str


def secrets(config: HostConfig) -> list[Secret]:
    """Secrets read from files on the control machine, root's only on the host: the HF token,
    and the API key as the snippet the front includes (validation checked its characters, so
    it needs no escaping inside nginx's quotes). The engines never hold the key."""
    result = []
    if config.hf_token_file:
        token = Path(config.hf_token_file).expanduser().read_text().strip()
        result.append(Secret(config.hf_token_path, f"{token}\n", "600", "root"))
    if config.api_key_file:
        key = Path(config.api_key_file).expanduser().read_text().strip()
        result.append(Secret(config.front_key_path, f'set $sparkform_api_key "{key}";\n', "600", "root"))
    if config.alert_webhook_file:
        url = Path(config.alert_webhook_file).expanduser().read_text().strip()
        result.append(Secret(config.alert_webhook_path, f"{url}\n", "600", "root"))
    return result


def unwanted(config: HostConfig) -> list[str]:
    """Files that must not be on the host: the engines' old copy of the API key (before the
    front), Debian's default nginx site, and the front's key and the alert webhook once the
    inventory names none."""
    paths = [f"{config.config_dir}/secrets/engine.env", NGINX_DEFAULT_SITE]
    return (paths + ([] if config.api_key_file else [config.front_key_path])
            + ([] if config.alert_webhook_file else [config.alert_webhook_path]))


@operation()
def removed(path: str, current: RemoteFile | None):
    """
    Remove a file (or a symlink, not what it points at).

    + path: file on the host
    + current: the host's copy from the SparkformHost fact, None when absent
    """
    if current is None:
        host.noop(f"{path} is absent")
        return
    yield f"rm -f {shlex.quote(path)}"
