#!/usr/bin/env python3
"""Busy, not hung, at full length: the guard's watchdog under long generations, for some rounds.

    bench/busy.py [--rounds 3] [--generations 40] [--hog CPUS]

Needs a converged sandbox (`make sandbox`; SPARKFORM_SANDBOX picks another). Each round queues
GENERATIONS long completions (1,800 tokens each, in loops) on q38, far past its sequence slots,
so the guard's own probes wait past the sandbox's deadline while the engine generates; then waits
for the guard's verdict on q38 in its journal, up to the longest a starved machine may hold it
(3 x the watchdog's rounds). --hog CPUS spins that many busy processes on this machine meanwhile,
the load of a CI run's other sandboxes. Prints per round: the seconds to the verdict, the verdict
(busy, starved then busy, hung) and the machine's CPU pressure then. The suite proves the
mechanism once with a short deadline (tests/integration/test_watchful.py); this measures how the
daemon's verdict holds at the sandbox's own settings and a given load.

Exit codes: 0 every round's verdict was "busy" and q38 kept its process; 1 otherwise.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import sys
import time
from pathlib import Path

from sparkform.host.watchdog import HangJudge
from sparkform.rules.inventory import load_inventory
from sparkform.sandbox import machine

# The live tests' helpers (their sandbox inventory, ssh, the engines' URLs) are no part of the package.
sys.path.append(str(Path(__file__).resolve().parent.parent / "tests" / "integration"))
from deploy_helpers import SANDBOX_INVENTORY, engine_url, long_generations, ssh, unit_properties, watchdog_verdict_s  # noqa: E402

UNIT = "vllm-q38.service"
LOAD_UNIT = "bench-long-generations"
VERDICTS = {"busy, not hung": "busy", "on a starved machine: waiting": "starved", "made no progress": "hung"}


def spin() -> None:
    while True:
        pass


def verdicts(box: machine.Sandbox, since: float) -> list[tuple[float, str]]:
    """The guard's verdicts on q38 since `since` (the host's clock), each with its time there."""
    return parse_verdicts(
        ssh(
            box,
            f"journalctl -t sparkform-guard --since @{since:.3f} --no-pager -o short-unix | grep -F {UNIT}",
            check=False,
        ).stdout
    )


def parse_verdicts(journal: str) -> list[tuple[float, str]]:
    """The verdicts in the guard's journal lines (journalctl -o short-unix), with their times."""
    return [
        (float(line.split()[0]), verdict)
        for line in journal.splitlines()
        for text, verdict in VERDICTS.items()
        if text in line and re.match(r"\d+\.\d+ ", line)
    ]


def cpu_pressure(box: machine.Sandbox) -> str:
    return ssh(box, "awk '/^some/ {print $2}' /proc/pressure/cpu", check=False).stdout.strip()


def one_round(box: machine.Sandbox, generations: int, bound_s: float) -> tuple[float | None, list[str], str]:
    """The seconds from the load's start to the guard's verdict on q38, by the host's journal
    (None: none within `bound_s`), the verdicts it journaled until then, and the CPU pressure
    when it was seen."""
    ssh(box, f"cat > /root/{LOAD_UNIT}.sh <<'EOF'\n{long_generations('q38', generations)}\nEOF")
    since = float(ssh(box, "date +%s.%N").stdout)
    ssh(box, f"systemd-run --quiet --collect --unit={LOAD_UNIT} bash /root/{LOAD_UNIT}.sh")
    said: list[tuple[float, str]] = []
    try:
        while float(ssh(box, "date +%s.%N").stdout) - since < bound_s:
            said = verdicts(box, since)
            final = [at for at, verdict in said if verdict != "starved"]
            if final:
                return final[0] - since, [v for at, v in said if at <= final[0]], cpu_pressure(box)
            time.sleep(2)
        return None, [v for _, v in said], cpu_pressure(box)
    finally:
        ssh(box, f"systemctl stop {LOAD_UNIT}.service", check=False)


def idle(box: machine.Sandbox) -> bool:
    metrics = ssh(box, f"curl -s {engine_url('q38', '/metrics')}", check=False).stdout
    return bool(re.search(r"^vllm:num_requests_running\{.*\} 0", metrics, re.M))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--generations", type=int, default=40)
    parser.add_argument("--hog", type=int, default=0, metavar="CPUS")
    args = parser.parse_args(argv)
    box = machine.get(os.environ.get("SPARKFORM_SANDBOX", "sandbox"))
    config = load_inventory(SANDBOX_INVENTORY)[0].config
    bound_s = HangJudge.STARVED_ROUNDS * watchdog_verdict_s(config)
    hogs = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.hog)]
    for hog in hogs:
        hog.start()
    print(
        f"busy: {args.rounds} rounds of {args.generations} long generations on q38 (sandbox {box.name}), "
        f"{args.hog} CPU hogs here; watchdog every {config.watchdog_interval_s} s, deadline "
        f"{config.watchdog_deadline_s} s, {config.watchdog_failures} failures; bound {bound_s:.0f} s",
        flush=True,
    )
    before, kept = unit_properties(box, UNIT, "MainPID")["MainPID"], True
    for number in range(1, args.rounds + 1):
        took, said, pressure = one_round(box, args.generations, bound_s)
        verdict = said[-1] if said else "none"
        kept = kept and verdict == "busy"
        print(
            f"  round {number}: {verdict} after {took:.0f} s" if took is not None else f"  round {number}: no verdict",
            f"(journaled: {', '.join(said) or 'nothing'}; CPU pressure {pressure})",
            flush=True,
        )
        deadline = time.monotonic() + 120
        while not idle(box) and time.monotonic() < deadline:
            time.sleep(2)
    for hog in hogs:
        hog.terminate()
    same = unit_properties(box, UNIT, "MainPID")["MainPID"] == before
    print(f"q38 kept its process: {'yes' if same else 'no'}")
    return 0 if kept and same else 1


if __name__ == "__main__":
    sys.exit(main())
