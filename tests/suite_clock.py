"""Where the suite's time goes: wall time per test module, its setups apart, printed at the end of
every run (CI's log ends with it), so the next test's cost is visible.

A test's setup includes the fixtures it is the first to need: for an integration module's first
test that is the sandbox's boot and its converge, so the `setup` column is the module's sandbox
setup. Under xdist the controller gets every worker's reports; `worker` says where a module ran,
and the modules of one worker add up to about the run's wall time.

Each integration module declares its budget, CI_MINUTES (tests/chains.py orders the work by it):
a module over its budget by a third gets a warning under the table, naming it, so a new test's
cost shows in the change that adds it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import pytest
from chains import INTEGRATION, declared


@dataclass
class ModuleTime:
    tests: set[str] = field(default_factory=set)
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    by_worker: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # seconds each worker spent

    @property
    def workers(self) -> list[str]:
        return sorted(self.by_worker)

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def worker_of(report: pytest.TestReport) -> str:
    """xdist's worker id (gw0, gw1, ...) of a report the controller got; "main" without xdist."""
    node = getattr(report, "node", None)
    return node.gateway.id if node is not None else "main"


def table(modules: dict[str, ModuleTime], wall_s: float) -> list[str]:
    """The table's lines, slowest module first; a line per worker with its modules' sum."""
    width = max([len("module"), *map(len, modules)])
    lines = [f"{'module':<{width}}  tests  setup s  call s  teardown s  total s  worker"]
    by_worker: dict[str, float] = defaultdict(float)
    for name, entry in sorted(modules.items(), key=lambda item: -item[1].total):
        worker = ",".join(entry.workers)
        for one, seconds in entry.by_worker.items():
            by_worker[one] += seconds
        lines.append(
            f"{name:<{width}}  {len(entry.tests):>5}  {entry.seconds['setup']:>7.0f}  {entry.seconds['call']:>6.0f}"
            f"  {entry.seconds['teardown']:>10.0f}  {entry.total:>7.0f}  {worker}"
        )
    for worker, seconds in sorted(by_worker.items()):
        lines.append(f"worker {worker}: {seconds:.0f} s of tests")
    lines.append(f"wall time: {wall_s:.0f} s ({wall_s / 60:.1f} min)")
    return lines


OVER_BUDGET = 4 / 3  # a module this far over its CI_MINUTES is named


def over_budget(
    modules: dict[str, ModuleTime], budget_of=lambda module: declared(module).get("CI_MINUTES")
) -> list[str]:
    """A warning per module whose time passed its declared CI_MINUTES by a third."""
    warnings = []
    for name, entry in sorted(modules.items()):
        budget = budget_of(name)
        if isinstance(budget, (int, float)) and entry.total > budget * 60 * OVER_BUDGET:
            warnings.append(
                f"WARNING: {name} took {entry.total / 60:.1f} min, over its budget of {budget} min"
                f" (CI_MINUTES) by more than a third: make it cheaper, or raise its budget in the same change"
            )
    return warnings


class SuiteClock:
    """Adds up every report's duration by module and phase; prints the table last."""

    def __init__(self) -> None:
        self.modules: dict[str, ModuleTime] = defaultdict(ModuleTime)
        self.live: dict[str, float] = defaultdict(float)  # each live test's seconds, its setups included
        self.started = time.monotonic()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.nodeid.startswith(INTEGRATION):
            self.live[report.nodeid] += report.duration
        entry = self.modules[module_of(report.nodeid)]
        entry.tests.add(report.nodeid)
        entry.seconds[report.when] += report.duration
        entry.by_worker[worker_of(report)] += report.duration

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.modules:
            return
        if self.live:
            terminalreporter.section("what each live test cost (s, setup and teardown included)")
            for nodeid, seconds in sorted(self.live.items(), key=lambda item: -item[1]):
                terminalreporter.write_line(f"{seconds:7.0f}  {nodeid.removeprefix(INTEGRATION)}")
        terminalreporter.section("time per test module (setup: fixtures, an integration module's sandbox)")
        for line in table(self.modules, time.monotonic() - self.started):
            terminalreporter.write_line(line)
        for line in over_budget(self.modules):
            terminalreporter.write_line(line, yellow=True)
