"""Where the suite's time goes: wall time per test module, its setups apart, and each live test's
wall and CPU seconds, printed at the end of every run (CI's log ends with it), so the next test's
cost is visible.

A test's setup includes the fixtures it is the first to need: for an integration module's first
test that is the sandbox's boot and its converge, so the `setup` column is the module's sandbox
setup. Under xdist the controller gets every worker's reports; `worker` says where a module ran,
and the modules of one worker add up to about the run's wall time.

Each integration module declares its budget, CI_MINUTES (tests/chains.py orders the work by it):
a module over its budget by a third gets a warning under the table, naming it, so a new test's
cost shows in the change that adds it.

On two loaded cores wall time misleads: a test that waits looks as costly as one that burns the
CPU. So every report carries two CPU readings, taken where the test ran (tests/conftest.py): the
CPU seconds of each sandbox the test names (SPARKFORM_SANDBOX, SPARKFORM_SANDBOX_PAIR), from the
sandbox's cgroup, and the worker's own since its collection, its children's included (pyinfra,
ssh). The controller charges each phase its readings minus the previous ones of the same sandbox
and of the same worker: a sandbox's first reading counts from its boot, so its boot and first
converge land in the setup that brought it up. A live test's line, and a module's `cpu s`, show
both added up; "-" where nothing was read (no sandbox cgroup found).
"""

from __future__ import annotations

import os
import resource
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from chains import INTEGRATION, declared

from sparkform.sandbox import registry
from sparkform.sandbox.system import read_lines


@dataclass
class ModuleTime:
    tests: set[str] = field(default_factory=set)
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    by_worker: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # seconds each worker spent
    cpu_s: float | None = None  # its tests' CPU seconds, in sandboxes and on this machine; None: nothing read

    @property
    def workers(self) -> list[str]:
        return sorted(self.by_worker)

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


@dataclass
class LiveCost:
    """A live test's seconds, its setups and teardowns included; a CPU figure is None while
    nothing was read."""

    wall_s: float = 0.0
    sandbox_cpu_s: float | None = None  # in its sandboxes
    local_cpu_s: float | None = None  # on this machine: its worker and the worker's children

    @property
    def cpu_s(self) -> float:
        return (self.sandbox_cpu_s or 0.0) + (self.local_cpu_s or 0.0)


def plus(total: float | None, more: float | None) -> float | None:
    """A sum that stays None (absent) while nothing was added."""
    return total if more is None else (total or 0.0) + more


def sandbox_cpu_s(name: str, runtime_root: Path = registry.RUNTIME_ROOT) -> float | None:
    """Sandbox `name`'s CPU seconds since it booted, from the cgroup folders its runtime folder lists
    (v1's cpuacct.usage, v2's cpu.stat); None when it is down or neither file is there."""
    for folder in map(Path, read_lines(runtime_root / name / "cgroups")):
        try:
            if (folder / "cpuacct.usage").is_file():
                return int((folder / "cpuacct.usage").read_text()) / 1e9
            stat = dict(line.split() for line in (folder / "cpu.stat").read_text().splitlines())
        except FileNotFoundError:
            continue  # not this hierarchy's file, or the folder went with `down` meanwhile
        if "usage_usec" in stat:  # v2's: v1's cpu controller has a cpu.stat without it
            return int(stat["usage_usec"]) / 1e6
    return None


def local_cpu_s() -> float:
    """This process's CPU seconds and its waited-for children's, user and system."""
    return sum(
        usage.ru_utime + usage.ru_stime
        for usage in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    )


def named_sandboxes() -> set[str]:
    """The sandboxes the running test's inventories point at (tests/integration: `box`, `pair`)."""
    pair = os.environ.get("SPARKFORM_SANDBOX_PAIR", "").split(",")
    return {name for name in [os.environ.get("SPARKFORM_SANDBOX", ""), *pair] if name}


def cpu_readings(
    sandboxes: Iterable[str], since: float, runtime_root: Path = registry.RUNTIME_ROOT
) -> list[tuple[str, object]]:
    """A report's CPU readings, as user properties (xdist takes them to the controller): each of the
    sandboxes that is up, and this process's CPU seconds since `since`."""
    read = {name: sandbox_cpu_s(name, runtime_root) for name in sorted(sandboxes)}
    return [
        ("sandbox_cpu_s", {name: seconds for name, seconds in read.items() if seconds is not None}),
        ("local_cpu_s", local_cpu_s() - since),
    ]


def growth(reading: float, last: float) -> float:
    """What a cumulative CPU counter grew by since `last`; from 0 when it went back (a new cgroup:
    a sandbox of that name brought up again)."""
    return reading - last if reading >= last else reading


def cell(seconds: float | None, width: int) -> str:
    """Seconds right-aligned in `width`, or "-" where nothing was read."""
    return f"{'-' if seconds is None else f'{seconds:.0f}':>{width}}"


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def worker_of(report: pytest.TestReport) -> str:
    """xdist's worker id (gw0, gw1, ...) of a report the controller got; "main" without xdist."""
    node = getattr(report, "node", None)
    return node.gateway.id if node is not None else "main"


def table(modules: dict[str, ModuleTime], wall_s: float) -> list[str]:
    """The table's lines, slowest module first; a line per worker with its modules' sum."""
    width = max([len("module"), *map(len, modules)])
    lines = [f"{'module':<{width}}  tests  setup s  call s  teardown s  total s  cpu s  worker"]
    by_worker: dict[str, float] = defaultdict(float)
    for name, entry in sorted(modules.items(), key=lambda item: -item[1].total):
        worker = ",".join(entry.workers)
        for one, seconds in entry.by_worker.items():
            by_worker[one] += seconds
        lines.append(
            f"{name:<{width}}  {len(entry.tests):>5}  {entry.seconds['setup']:>7.0f}  {entry.seconds['call']:>6.0f}"
            f"  {entry.seconds['teardown']:>10.0f}  {entry.total:>7.0f}  {cell(entry.cpu_s, 5)}  {worker}"
        )
    for worker, seconds in sorted(by_worker.items()):
        lines.append(f"worker {worker}: {seconds:.0f} s of tests")
    lines.append(f"wall time: {wall_s:.0f} s ({wall_s / 60:.1f} min)")
    return lines


def live_lines(live: dict[str, LiveCost], wall_s: float, cores: int) -> list[str]:
    """Each live test's seconds, the longest first, and what CPU they took of the run's capacity."""
    lines = ["  wall s  sandbox cpu s  local cpu s  test"]
    for nodeid, cost in sorted(live.items(), key=lambda item: -item[1].wall_s):
        lines.append(
            f"{cost.wall_s:8.0f}  {cell(cost.sandbox_cpu_s, 13)}  {cell(cost.local_cpu_s, 11)}"
            f"  {nodeid.removeprefix(INTEGRATION)}"
        )
    cpu_s, capacity_s = sum(cost.cpu_s for cost in live.values()), wall_s * cores
    lines.append(
        f"live tests' CPU: {cpu_s:.0f} s, {cpu_s / capacity_s:.0%} of the run's {capacity_s:.0f} CPU s"
        f" ({wall_s:.0f} s wall x {cores} cores)"
    )
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
    """Adds up every report's duration by module and phase, and its CPU; prints the tables last."""

    def __init__(self) -> None:
        self.modules: dict[str, ModuleTime] = defaultdict(ModuleTime)
        self.live: dict[str, LiveCost] = defaultdict(LiveCost)
        self.sandbox_read: dict[str, float] = {}  # each sandbox's latest CPU reading
        self.local_read: dict[str, float] = {}  # each worker's latest
        self.started = time.monotonic()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        sandbox_s, local_s = self.cpu_of(report)
        if report.nodeid.startswith(INTEGRATION):
            cost = self.live[report.nodeid]
            cost.wall_s += report.duration
            cost.sandbox_cpu_s = plus(cost.sandbox_cpu_s, sandbox_s)
            cost.local_cpu_s = plus(cost.local_cpu_s, local_s)
        entry = self.modules[module_of(report.nodeid)]
        entry.tests.add(report.nodeid)
        entry.seconds[report.when] += report.duration
        entry.by_worker[worker_of(report)] += report.duration
        entry.cpu_s = plus(plus(entry.cpu_s, sandbox_s), local_s)

    def cpu_of(self, report: pytest.TestReport) -> tuple[float | None, float | None]:
        """The CPU seconds the report's phase took in its sandboxes and on this machine (None: not read)."""
        properties = dict(report.user_properties)
        read = properties.get("sandbox_cpu_s") or {}
        sandbox_s = sum(growth(s, self.sandbox_read.get(name, 0.0)) for name, s in read.items()) if read else None
        self.sandbox_read.update(read)
        local = properties.get("local_cpu_s")
        if local is None:
            return sandbox_s, None
        worker = worker_of(report)
        local_s, self.local_read[worker] = local - self.local_read.get(worker, 0.0), local
        return sandbox_s, local_s

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.modules:
            return
        wall_s = time.monotonic() - self.started
        if self.live:
            terminalreporter.section("what each live test cost (s, setup and teardown included)")
            for line in live_lines(self.live, wall_s, os.cpu_count() or 1):
                terminalreporter.write_line(line)
        terminalreporter.section("time per test module (setup: fixtures, an integration module's sandbox)")
        for line in table(self.modules, wall_s):
            terminalreporter.write_line(line)
        for line in over_budget(self.modules):
            terminalreporter.write_line(line, yellow=True)
