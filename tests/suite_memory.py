"""How much of the machine's memory the suite holds, and how many sandboxes it keeps up at once.

- `MemoryPeak`, the controller's plugin: samples MemAvailable every second from the run's start
  and prints, last, the suite's peak: how far below its value at the start MemAvailable went
  (every sandbox, engine, xdist worker and tool the run started, page cache it cannot drop
  included) and the tests that ran at that moment (the lever to pull), with a warning past
  BUDGET_GIB, so a developer's own sandbox fits beside a run.
- `sandbox_slots(n)`: held while n sandboxes that run engines are up (a module's, the shared
  one, the pair's two); at most SANDBOXES (the setting SPARKFORM_TEST_SANDBOXES, `make test
  TEST_SANDBOXES=N`) are up at once across the xdist workers, and a worker that wants one more
  waits for another's to go down. The bare sandboxes of tests/integration/test_sandbox_host.py
  (systemd and sshd, tens of MiB each, for seconds) take none.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from sparkform.readers.parsers import parse_meminfo
from sparkform.sandbox import registry

BUDGET_GIB = 12.0  # the suite's share of this 24 GiB machine: a developer's sandbox fits beside it
SANDBOXES = int(os.environ.get("SPARKFORM_TEST_SANDBOXES", "4"))
SLOT = registry.RUNTIME_ROOT / ".test-sandbox-slot.{}"
SLOT_POLL_S = 1.0


def available_gib(meminfo: Path = Path("/proc/meminfo")) -> float:
    return parse_meminfo(meminfo.read_text().splitlines())["mem_available_gib"]


class MemoryPeak:
    """Samples MemAvailable in a thread of the controller; prints the peak use at the end."""

    def __init__(self, sample=available_gib, interval_s: float = 1.0) -> None:
        self.sample = sample
        self.start_gib = sample()
        self.lowest_gib = self.start_gib
        self.running: set[str] = set()  # the tests under way on any worker (their setup to their teardown)
        self.running_at_lowest: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(interval_s,), daemon=True)
        self._thread.start()

    def _watch(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            available = self.sample()
            if available < self.lowest_gib:
                with self._lock:
                    self.lowest_gib, self.running_at_lowest = available, sorted(self.running)

    def pytest_runtest_logstart(self, nodeid, location) -> None:
        with self._lock:
            self.running.add(nodeid)

    def pytest_runtest_logfinish(self, nodeid, location) -> None:
        with self._lock:
            self.running.discard(nodeid)

    @property
    def peak_gib(self) -> float:
        return self.start_gib - self.lowest_gib

    def lines(self) -> list[str]:
        lines = [
            f"peak memory of the suite: {self.peak_gib:.1f} GiB (MemAvailable {self.start_gib:.1f} GiB at the start, "
            f"{self.lowest_gib:.1f} GiB at its lowest); at most {SANDBOXES} sandboxes up at once"
        ]
        if self.running_at_lowest:
            lines.append(f"at its lowest, these tests ran: {', '.join(self.running_at_lowest)}")
        if self.peak_gib > BUDGET_GIB:
            lines.append(
                f"WARNING: over the suite's {BUDGET_GIB:.0f} GiB: fewer sandboxes at once (make test TEST_SANDBOXES=N)"
            )
        return lines

    def stop(self) -> None:
        self._stop.set()

    def pytest_unconfigure(self, config) -> None:
        self.stop()

    def pytest_terminal_summary(self, terminalreporter) -> None:
        self.stop()
        terminalreporter.section("memory")
        for line in self.lines():
            terminalreporter.write_line(line)


@contextlib.contextmanager
def sandbox_slots(count: int = 1, slots: int = SANDBOXES) -> Iterator[None]:
    """Held while `count` sandboxes are up: that many of the run's `slots` slot locks, each a
    file lock that goes with this process if it dies."""
    if count > slots:
        raise ValueError(f"{count} sandboxes at once, but SPARKFORM_TEST_SANDBOXES is {slots}")
    registry.RUNTIME_ROOT.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as held:
        handles = [held.enter_context(open(str(SLOT).format(index), "a")) for index in range(slots)]
        while True:
            taken = []
            for handle in handles:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                taken.append(handle)
                if len(taken) == count:
                    break
            if len(taken) == count:
                break
            for handle in taken:  # all or none: two workers that each hold a part never wait on each other
                fcntl.flock(handle, fcntl.LOCK_UN)
            time.sleep(SLOT_POLL_S)
        yield
