"""`sparkform logs [INVENTORY] [ENGINE]`: journals of a host, read over SSH: the engine's, or
without one every journal of sparkform's on the host merged in time order (the engines, the
guard, the retries of a spent start limit, the scrub, the front).

Every line an engine and its unit write goes to journald under the engine's unit (the launch
script's refusals, vLLM's own log, the readiness helper, systemd's start and stop lines), so one
`journalctl -u` shows why an engine is not serving; the merged journal shows it beside what the
guard did about it.

Exit codes: journalctl's (0, or 1 with its own line); 1 the host did not answer over SSH (said in
one line of sparkform's, with ssh's reason); 2 an engine, a host or a --since it cannot use; 130
Ctrl-C (what -f ends with).
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
from sparkform.domain import exits
from sparkform.domain.layout import FRONT_UNIT, GUARD_UNIT, RECOVER_UNIT, SCRUB_UNIT
from sparkform.domain.model import Host
from sparkform.rules.inventory import INVENTORY_HELP, load_inventory, raw_inventory

# What journalctl's --since takes (`-1h`, given as --since=-1h; `2026-11-30 10:00`, `today`,
# `1 hour ago`); nothing a shell would read as syntax.
SINCE_PATTERN = re.compile(r"[A-Za-z0-9 :+.-]{1,40}")


def journal_command(matches: list[str], since: str | None, boot: bool, follow: bool) -> str:
    """The journalctl command line run on the host, for these matches (`-u UNIT`, or journalctl's
    FIELD=VALUE matches joined by "+"), in time order."""
    words = ["journalctl", *matches, "--no-pager", "-o", "short-iso"]
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


# Lines that sparkform's programs write from units of their own (an alert sent from a transient
# unit, the scrub's retries, a rollback), by the name they write under.
IDENTIFIERS = ("sparkform-guard", "sparkform-scrub", "sparkform-rollback")


def host_matches(host: Host) -> list[str]:
    """journalctl's matches for every journal of sparkform's on the host, any of them: each unit's
    own lines and systemd's about it (the engines, the guard, each engine's recovery, the scrub,
    the front), and the lines its programs write from units of their own."""
    config = host.config
    units = [
        *(engine.unit for engine in config.engines),
        GUARD_UNIT,
        *(RECOVER_UNIT.replace("@.", f"@{engine.name}.") for engine in config.engines),
        SCRUB_UNIT,
        FRONT_UNIT,
    ]
    matches = [match for unit in units for match in (f"_SYSTEMD_UNIT={unit}", f"UNIT={unit}")]
    matches += [f"SYSLOG_IDENTIFIER={name}" for name in IDENTIFIERS]
    return [word for match in matches for word in (match, "+")][:-1]


def run(args: argparse.Namespace) -> int:
    if args.since is not None and not SINCE_PATTERN.fullmatch(args.since):
        print(
            f"sparkform logs: --since {args.since!r} is not a time journalctl reads (e.g. today, -1h)", file=sys.stderr
        )
        return exits.USAGE
    hosts = load_inventory(args.inventory)
    engine = args.engine or args.engine_option
    try:
        if engine is not None:
            target = engine_host(hosts, engine, args.host)
            matches = ["-u", next(e.unit for e in target.config.engines if e.name == engine)]
        else:
            target = pick_host(hosts, args.host)
            matches = host_matches(target)
    except ValueError as err:
        print(f"sparkform logs: {err}", file=sys.stderr)
        return exits.USAGE
    with tempfile.TemporaryDirectory(prefix="sparkform-logs-") as folder:
        config = ssh.write_config(target.name, raw_inventory(args.inventory)[target.name], Path(folder))
        command = journal_command(matches, args.since, args.boot, args.follow)
        # The journal streams through; ssh's own complaints are kept to say why in one line.
        result = subprocess.run(
            ["ssh", "-F", str(config), ssh.alias(target.name), command], stderr=subprocess.PIPE, text=True
        )
    if result.returncode == ssh.NO_CONNECTION:
        print(f"sparkform logs: {target.name} does not answer over SSH ({ssh.failure(result)})", file=sys.stderr)
        return exits.FAILED
    sys.stderr.write(result.stderr)
    return result.returncode


def pick_host(hosts: list[Host], host: str | None) -> Host:
    """The host named, or the inventory's only one; ValueError says why there is none."""
    picked = [h for h in hosts if host in (None, h.name)]
    if len(picked) == 1:
        return picked[0]
    names = ", ".join(h.name for h in hosts)
    raise ValueError(
        f"the inventory has no host {host!r} ({names})" if host else f"choose a host with --host ({names})"
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    logs = sub.add_parser("logs", help="a host's journals merged in time order, or one engine's (journalctl over SSH)")
    logs.add_argument("inventory", type=Path, nargs="?", help=INVENTORY_HELP)
    logs.add_argument("engine", nargs="?", help="the engine's name in the inventory (none: every journal of the host)")
    logs.add_argument("--engine", dest="engine_option", metavar="ENGINE", help="the same, as an option")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines (Ctrl-C stops)")
    logs.add_argument("--since", help="from this time on, as journalctl reads it: today, '1 hour ago', --since=-1h")
    logs.add_argument("--boot", action="store_true", help="this boot only")
    logs.add_argument("--host", help="the host, when the inventory has several")
    logs.set_defaults(run=run)
