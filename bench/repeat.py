#!/usr/bin/env python3
"""The statistical forms of live tests that CI runs once: one test of tests/integration repeated
for a bounded number of rounds on a fresh sandbox (or SPARKFORM_TEST_REUSE=NAME, one already up
and converged), printing each round's figure.

  bench/repeat.py double-crash [ROUNDS]   both EngineCores killed at once ROUNDS times in a row
                                          (default 10: past the start limit's burst of 3), every
                                          other round q38 first; prints the seconds until both
                                          serve again, each round (~1 min a round here)
  bench/repeat.py pair-reboots [ROUNDS]   the two-host pair: a reboot of the head, ROUNDS times
                                          (default 3; ~2 min a round)

Exit codes: 0 every round passed; 1 a round failed (pytest's output says which); 2 bad usage.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Each repeat: the variable its test reads its rounds from, the rounds unless told, the test.
REPEATS = {
    "double-crash": (
        "SPARKFORM_DOUBLE_CRASHES",
        10,
        "tests/integration/test_watchful.py::test_both_engine_cores_killed_at_once_repeatedly_serve_again_each_time",
    ),
    "pair-reboots": (
        "SPARKFORM_PAIR_REBOOTS",
        3,
        "tests/integration/test_pair.py::test_a_reboot_of_the_head_brings_the_pair_back",
    ),
}


def rounds(text: str) -> int:
    if not re.fullmatch(r"[1-9][0-9]?", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a count of rounds from 1 to 99")
    return int(text)


def pytest_run(repeat: str, count: int | None) -> tuple[list[str], dict[str, str]]:
    """The pytest command that repeats `repeat` `count` times (None: its default), and the
    variable that tells its test how many."""
    variable, default, test = REPEATS[repeat]
    # -p no:xdist: one process, the test's own prints (-s) as they come.
    return [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:xdist", test], {variable: str(count or default)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("repeat", choices=sorted(REPEATS))
    parser.add_argument("rounds", nargs="?", type=rounds)
    args = parser.parse_args(argv)
    command, variables = pytest_run(args.repeat, args.rounds)
    return 0 if subprocess.run(command, cwd=ROOT, env={**os.environ, **variables}).returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
