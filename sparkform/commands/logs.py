"""`sparkform logs INVENTORY ENGINE`: the engine's journal on its host, read over SSH.

Every line an engine and its unit write goes to journald under the engine's unit (the launch
script's refusals, vLLM's own log, the readiness helper, systemd's start and stop lines), so one
`journalctl -u` shows why an engine is not serving.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from sparkform.commands import ssh
from sparkform.inventory import load_inventory, raw_inventory
from sparkform.model import Host

# What journalctl's --since takes (`-1h`, given as --since=-1h; `2026-11-30 10:00`, `today`,
# `1 hour ago`); nothing a shell would read as syntax.
SINCE_PATTERN = re.compile(r"[A-Za-z0-9 :+.-]{1,40}")
EXIT_USAGE = 2


def journal_command(unit: str, since: str | None, boot: bool, follow: bool) -> str:
    """The journalctl command line run on the host."""
    words = ["journalctl", "-u", unit, "--no-pager", "-o", "short-iso"]
    words += ["--since", since] if since else []
    words += ["-b"] if boot else []
    words += ["-f"] if follow else []
    return shlex.join(words)


def engine_host(hosts: list[Host], engine: str, host: str | None) -> Host:
    """The one host that runs `engine` (of `host` when given); ValueError says why there is none."""
    serving = [h for h in hosts if (host is None or h.name == host) and engine in {e.name for e in h.config.engines}]
    if len(serving) == 1:
        return serving[0]
    if serving:
        raise ValueError(f"engine {engine} runs on {', '.join(h.name for h in serving)}: choose one with --host")
    known = sorted({e.name for h in hosts if host is None or h.name == host for e in h.config.engines})
    where = f"host {host}" if host else "the inventory"
    raise ValueError(f"{where} has no engine {engine!r} (engines: {', '.join(known) or 'none'})")


def run(args: argparse.Namespace) -> int:
    """Exit code: journalctl's (255: no SSH connection); 2 for an engine or --since it cannot use."""
    if args.since is not None and not SINCE_PATTERN.fullmatch(args.since):
        print(
            f"sparkform logs: --since {args.since!r} is not a time journalctl reads (e.g. today, -1h)", file=sys.stderr
        )
        return EXIT_USAGE
    hosts = load_inventory(args.inventory)
    try:
        target = engine_host(hosts, args.engine, args.host)
    except ValueError as err:
        print(f"sparkform logs: {err}", file=sys.stderr)
        return EXIT_USAGE
    unit = next(e.unit for e in target.config.engines if e.name == args.engine)
    with tempfile.TemporaryDirectory(prefix="sparkform-logs-") as folder:
        config = ssh.write_config(target.name, raw_inventory(args.inventory)[target.name], Path(folder))
        command = journal_command(unit, args.since, args.boot, args.follow)
        return subprocess.call(["ssh", "-F", str(config), ssh.alias(target.name), command])


def add_parser(sub: argparse._SubParsersAction) -> None:
    logs = sub.add_parser("logs", help="an engine's journal on its host (journalctl over SSH)")
    logs.add_argument("inventory", type=Path)
    logs.add_argument("engine", help="the engine's name in the inventory")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines (Ctrl-C stops)")
    logs.add_argument("--since", help="from this time on, as journalctl reads it: today, '1 hour ago', --since=-1h")
    logs.add_argument("--boot", action="store_true", help="this boot only")
    logs.add_argument("--host", help="the host, when several run an engine of that name")
    logs.set_defaults(run=run)
