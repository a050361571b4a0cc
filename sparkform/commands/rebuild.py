"""`sparkform rebuild`: right after a firmware reboot, wait for each host over SSH, converge it,
and print each engine's start beside the one the host record kept."""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sparkform.commands import ssh
from sparkform.domain.layout import record_path
from sparkform.domain.package_data import DEPLOY
from sparkform.readers.hostrecord import HostRecord, UntrustedValue
from sparkform.rules.inventory import INVENTORY_HELP, load_inventory, raw_inventory

WAIT_POLL_S = 5.0


def _wait_for_ssh(config: Path, name: str, wait_s: float) -> str | None:
    """Poll until the host answers over SSH (it may still be rebooting): None, or why it did not
    within `wait_s`. A refused host key or login ends the wait at once (waiting mends neither)."""
    deadline = time.monotonic() + wait_s
    while True:
        reason = ssh.unreachable(config, name)
        if reason is None or ssh.lasting(reason) or time.monotonic() >= deadline:
            return reason
        time.sleep(WAIT_POLL_S)


def _read_record(config: Path, name: str, state_dir: str) -> HostRecord | None:
    result = ssh.run(config, name, f"cat {shlex.quote(record_path(state_dir))} 2>/dev/null || true")
    try:
        return HostRecord.from_json(result.stdout)
    except UntrustedValue:
        return None  # the deploy stops on it and says why


def start_table(before: HostRecord | None, after: HostRecord | None) -> str:
    """Each engine's start as this rebuild found or made it, next to what was recorded before."""
    rows = [("engine", "this start", "kind", "recorded cold start", "recorded last start")]
    for name, now in after.engines.items() if after else []:
        old = before.engines.get(name) if before else None
        new_start = now.started_at is not None and (old is None or now.started_at != old.started_at)
        rows.append(
            (
                name,
                f"{now.start_s:.1f} s" if new_start and now.start_s else "-",
                ("cold" if now.last_start_cold else "warm") if new_start else "kept running",
                _seconds(old.cold_start_s if old else None),
                _seconds(old.start_s if old else None),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def run(args: argparse.Namespace) -> int:
    """Right after a reboot: wait for each host, converge it (the deploy reports the drift, moves
    stale JIT caches aside and warms the engines one at a time), then print each engine's start
    next to the recorded one. Exit code: pyinfra's; 1 when a host never answered."""
    hosts = load_inventory(args.inventory)
    raw = raw_inventory(args.inventory)
    with tempfile.TemporaryDirectory(prefix="sparkform-rebuild-") as folder:
        configs = {h.name: ssh.write_config(h.name, raw[h.name], Path(folder)) for h in hosts}
        before = {}
        for h in hosts:
            print(f"sparkform rebuild: waiting up to {args.wait:.0f} s for {h.name} to answer over SSH", flush=True)
            reason = _wait_for_ssh(configs[h.name], h.name, args.wait)
            if reason is not None:
                print(
                    f"sparkform rebuild: {h.name} does not answer over SSH ({reason}); nothing was changed",
                    file=sys.stderr,
                )
                return 1
            before[h.name] = _read_record(configs[h.name], h.name, h.config.state_dir)
        deploy = subprocess.run(
            [str(Path(sys.executable).with_name("pyinfra")), "-y", str(args.inventory.resolve()), str(DEPLOY)],
            cwd=DEPLOY.parent,
            # How the host lock's holder line names this run (sparkform/deploy/operations/hostlock.py).
            env={**os.environ, "SPARKFORM_COMMAND": f"sparkform rebuild {args.inventory}"},
        )
        for h in hosts:
            print(f"\n{h.name}: engine starts")
            print(start_table(before[h.name], _read_record(configs[h.name], h.name, h.config.state_dir)))
    if deploy.returncode:
        print(
            f"sparkform rebuild: the deploy failed (exit {deploy.returncode}); the record keeps the last "
            "converge, stale caches stay aside for the next try",
            file=sys.stderr,
        )
    return deploy.returncode


def add_parser(sub: argparse._SubParsersAction) -> None:
    rebuild = sub.add_parser("rebuild", help="after a reboot: wait for the hosts, converge, print engine start times")
    rebuild.add_argument("inventory", type=Path, nargs="?", help=INVENTORY_HELP)
    rebuild.add_argument("--wait", type=float, default=900.0, help="seconds to wait for each host's SSH (default 900)")
    rebuild.set_defaults(run=run)
