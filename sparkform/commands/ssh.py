"""OpenSSH configs from a host's pyinfra data, for the tools that reach hosts without pyinfra
(testinfra in `sparkform verify`, `sparkform rebuild`'s wait and record reads)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

HostT = TypeVar("HostT")
ReadT = TypeVar("ReadT")


def alias(host_name: str) -> str:
    """A Host alias OpenSSH accepts for a pyinfra host name (`@local`, names with slashes)."""
    return host_name.replace("@", "").replace("/", "_")


def write_config(host_name: str, data: dict[str, Any], folder: Path) -> Path:
    """An ssh_config for the host from its pyinfra data (ssh_hostname, ssh_user, ssh_port,
    ssh_key, ssh_known_hosts_file, ssh_strict_host_key_checking); connections share a master."""
    lines = [
        f"Host {alias(host_name)}",
        f"  HostName {data.get('ssh_hostname', host_name)}",
        f"  User {data.get('ssh_user', 'root')}",
        "  BatchMode yes",
        "  ConnectTimeout 10",
        "  ControlMaster auto",
        f"  ControlPath {folder}/cm-%C",
        "  ControlPersist 60",
    ]
    if data.get("ssh_port"):
        lines.append(f"  Port {data['ssh_port']}")
    if data.get("ssh_key"):
        lines.append(f"  IdentityFile {data['ssh_key']}")
    if data.get("ssh_known_hosts_file"):
        lines.append(f"  UserKnownHostsFile {data['ssh_known_hosts_file']}")
    strict = data.get("ssh_strict_host_key_checking")
    if strict is not None:
        lines.append(f"  StrictHostKeyChecking {strict}")
    path = folder / f"{alias(host_name)}.ssh_config"
    path.write_text("\n".join(lines) + "\n")
    return path


def run(
    config: Path, host_name: str, command: str, timeout: float = 60, stdin: str | None = None
) -> subprocess.CompletedProcess:
    """Run `command` on the host, `stdin` on its standard input; the result carries its exit code
    and output (255: no connection)."""
    return subprocess.run(
        ["ssh", "-F", str(config), alias(host_name), command],
        capture_output=True,
        text=True,
        timeout=timeout,
        input=stdin,
    )


def each_host(read: Callable[[HostT], ReadT], hosts: Sequence[HostT]) -> list[ReadT]:
    """`read` of every host, all at once, in the hosts' order. A lone host (most inventories) is read in
    this thread, so a Ctrl-C cuts its ssh wait at once (from a pool thread, the command waited for ssh's
    10 s connect timeout first)."""
    if len(hosts) == 1:
        return [read(hosts[0])]
    with ThreadPoolExecutor(len(hosts)) as pool:
        return list(pool.map(read, hosts))


NO_CONNECTION = 255  # ssh's exit code when it could not connect (or log in)
# ssh's last words when the host answered and refused the key or the login: waiting mends neither.
LASTING_FAILURES = ("Host key verification failed", "Permission denied")


def failure(result: subprocess.CompletedProcess) -> str:
    """Why a command over ssh failed, in ssh's own last line (exit 255: no connection)."""
    return (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[-1]


def unreachable(config: Path, host_name: str, timeout: float = 30) -> str | None:
    """Why the host does not answer over SSH now (ssh's last line); None when it does."""
    try:
        result = run(config, host_name, "true", timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"no answer within {timeout:.0f} s"
    return None if result.returncode == 0 else failure(result)


def lasting(reason: str) -> bool:
    """Whether waiting for the host cannot mend why it did not answer."""
    return any(words in reason for words in LASTING_FAILURES)
