#!/usr/bin/env python3
"""Benchmark: a no-op converge (nothing to change), wall time and remote commands, median of N.

    bench/noop_converge.py [INVENTORY] [--runs 5]       (default: inventory/sandbox.py, sandbox up)

Each run is the real `pyinfra -y INVENTORY deploy.py` in a child process whose SSH connector
counts every command it runs and every file it uploads. Prints one line per run and the medians.
Targets (issue: sandbox): under 3 s and under 30 remote commands.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Runs inside the child: count what the SSH connector sends, then hand over to pyinfra's CLI.
COUNTING_PYINFRA = """
import atexit, json, sys
from pyinfra.connectors.ssh import SSHConnector
counts_path = sys.argv.pop(1)
counts = {"commands": 0, "uploads": 0}
def counting(method, key):
    def wrapper(self, *args, **kwargs):
        counts[key] += 1
        return method(self, *args, **kwargs)
    return wrapper
SSHConnector.run_shell_command = counting(SSHConnector.run_shell_command, "commands")
SSHConnector.put_file = counting(SSHConnector.put_file, "uploads")
atexit.register(lambda: open(counts_path, "w").write(json.dumps(counts)))
from pyinfra_cli.main import main
sys.argv[0] = "pyinfra"
sys.exit(main())
"""


def one_run(inventory: Path) -> tuple[float, dict]:
    with tempfile.NamedTemporaryFile(suffix=".json") as counts_file:
        start = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-c", COUNTING_PYINFRA, counts_file.name, "-y", str(inventory), "deploy.py"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        elapsed = time.monotonic() - start
        if result.returncode != 0:
            sys.exit(f"pyinfra failed:\n{result.stdout}\n{result.stderr}")
        return elapsed, json.loads(Path(counts_file.name).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inventory", nargs="?", type=Path, default=ROOT / "inventory" / "sandbox.py")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    one_run(args.inventory)  # converge first, so the measured runs have nothing to do
    times, commands = [], []
    for index in range(args.runs):
        elapsed, counts = one_run(args.inventory)
        times.append(elapsed)
        commands.append(counts["commands"] + counts["uploads"])
        print(f"run {index + 1}: {elapsed:.2f} s, {counts['commands']} commands, {counts['uploads']} uploads")
    print(
        f"median: {statistics.median(times):.2f} s wall, {statistics.median(commands):.0f} remote commands "
        f"(targets: < 3 s, < 30)"
    )


if __name__ == "__main__":
    main()
