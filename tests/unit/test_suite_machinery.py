"""The suite's own machinery: the machine-state check finds what a test left outside its folders,
a killed run's sandboxes and temp folders are cleared by their names (and nothing else), a run
clears only while no other run holds the run lock, the time table adds up by module, and each
live test is charged the CPU its phases' readings differ by."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import suite_hygiene
import suite_memory
from chains import declared
from suite_clock import (
    LiveCost,
    ModuleTime,
    SuiteClock,
    cpu_readings,
    live_lines,
    local_cpu_s,
    named_sandboxes,
    over_budget,
    sandbox_cpu_s,
    table,
)
from suite_figures import SuiteFigures
from suite_hygiene import SANDBOX_NAME, changes, entries, leftover_sandboxes, sandbox_name
from suite_memory import MemoryPeak

from sparkform.sandbox import registry


def snapshot(root: Path) -> dict[str, tuple]:
    return dict(entries([str(root)]))


def test_a_file_left_changed_or_removed_under_a_watched_folder_is_named(tmp_path):
    etc = tmp_path / "etc"
    (etc / "nginx" / "conf.d").mkdir(parents=True)
    (etc / "kept").write_text("same\n")
    (etc / "edited").write_text("before\n")
    (etc / "gone").write_text("x\n")
    (etc / "link").symlink_to("kept")
    before = snapshot(etc)
    assert changes(before, snapshot(etc)) == []

    (etc / "nginx" / "conf.d" / "sparkform.conf").write_text("server {}\n")
    (etc / "edited").write_text("after, longer\n")
    (etc / "gone").unlink()
    (etc / "link").unlink()
    (etc / "link").symlink_to("elsewhere")
    (etc / "kept").chmod(0o600)
    assert changes(before, snapshot(etc)) == [
        f"created {etc}/nginx/conf.d/sparkform.conf",
        f"removed {etc}/gone",
        f"changed {etc}/edited",
        f"changed {etc}/kept",
        f"changed {etc}/link",
    ]


def test_a_file_made_and_removed_again_during_the_run_leaves_no_change(tmp_path):
    before = snapshot(tmp_path)
    (tmp_path / "scratch").write_text("x")
    (tmp_path / "scratch").unlink()
    assert changes(before, snapshot(tmp_path)) == []


def test_the_suites_sandbox_names_are_cleared_and_no_other_name(tmp_path):
    runtime, layers = tmp_path / "run", tmp_path / "layers"
    ours = [sandbox_name(), sandbox_name("head"), sandbox_name("worker")]
    theirs = ["sandbox", "t-1234", "spark-rehearsal", "t-0123456789", "t-zzzzzzzz"]
    for name in [*ours, *theirs]:
        (runtime / name).mkdir(parents=True)
    (layers / "t-abcdef01").mkdir(parents=True)  # a machine's layers whose /run went with a reboot
    assert all(registry.NAME_PATTERN.fullmatch(name) for name in ours)
    assert leftover_sandboxes(runtime, layers) == sorted([*ours, "t-abcdef01"])
    assert not [name for name in theirs if SANDBOX_NAME.fullmatch(name)]


def test_clearing_removes_a_killed_runs_remains_and_temp_folders(tmp_path, monkeypatch):
    """The remains of a sandbox that died without `down` (its runtime folder with its index, its
    layers on disk) and the suite's temp folders go; a user's sandbox and other temp folders stay."""
    runtime, cache = tmp_path / "run", tmp_path / "cache"
    monkeypatch.setattr(registry, "RUNTIME_ROOT", runtime)
    monkeypatch.setattr(suite_hygiene, "cache_dir", lambda: cache)
    planted = sandbox_name()
    for name in (planted, "sandbox"):
        (runtime / name).mkdir(parents=True)
        (runtime / name / "index").write_text("7\n")
        (cache / "sandboxes" / name / "upper" / "etc").mkdir(parents=True)
    temp = tmp_path / "tmp"
    for folder in ("sparkform-test-key-x1", "sparkform-test-wait-ready-x2", "pytest-of-root", "other"):
        (temp / folder).mkdir(parents=True)

    gone = suite_hygiene.clear_leftovers(temp)

    assert gone == [f"sandbox {planted}", f"{temp}/sparkform-test-key-x1", f"{temp}/sparkform-test-wait-ready-x2"]
    assert not (runtime / planted).exists() and not (cache / "sandboxes" / planted).exists()
    assert (runtime / "sandbox" / "index").exists() and (cache / "sandboxes" / "sandbox").exists()
    assert sorted(p.name for p in temp.iterdir()) == ["other", "pytest-of-root"]


def test_a_run_clears_only_while_no_other_run_holds_the_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(suite_hygiene, "RUN_LOCK", tmp_path / "run.lock")
    other = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_SH);"
            " print('held', flush=True); time.sleep(60)",
            str(tmp_path / "run.lock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert other.stdout.readline() == "held\n"
        handle, alone = suite_hygiene.hold_run_lock()
        assert not alone
        handle.close()
    finally:
        other.kill()
        other.wait()
    handle, alone = suite_hygiene.hold_run_lock()
    try:
        assert alone
        # Held shared now: a second run may join, but cannot clear.
        with open(tmp_path / "run.lock") as second, open(tmp_path / "run.lock") as third:
            fcntl.flock(second, fcntl.LOCK_SH | fcntl.LOCK_NB)
            with pytest.raises(BlockingIOError):
                fcntl.flock(third, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        handle.close()


def test_the_time_table_adds_up_each_modules_phases_and_each_workers_share():
    modules = {"tests/integration/test_a.py": ModuleTime(), "tests/unit/test_b.py": ModuleTime()}
    for name, worker, when, seconds in [
        ("tests/integration/test_a.py", "gw0", "setup", 200.0),
        ("tests/integration/test_a.py", "gw0", "call", 100.0),
        ("tests/integration/test_a.py", "gw0", "call", 50.0),
        ("tests/unit/test_b.py", "gw1", "call", 3.0),
        ("tests/unit/test_b.py", "gw0", "call", 1.0),
    ]:
        modules[name].seconds[when] += seconds
        modules[name].by_worker[worker] += seconds
        modules[name].tests.add(f"{name}::t{len(modules[name].tests)}")
    modules["tests/integration/test_a.py"].cpu_s = 412.25
    lines = table(modules, 400.0)
    assert lines[0].split()[-3:] == ["cpu", "s", "worker"]
    assert lines[1].split() == ["tests/integration/test_a.py", "3", "200", "150", "0", "350", "412", "gw0"]
    assert lines[2].split() == ["tests/unit/test_b.py", "2", "0", "4", "0", "4", "-", "gw0,gw1"]
    # Each worker's sum is what its reports took: gw0 350 + 1, gw1 3.
    assert lines[3:] == ["worker gw0: 351 s of tests", "worker gw1: 3 s of tests", "wall time: 400 s (6.7 min)"]


def test_a_sandboxs_cpu_seconds_come_from_the_cgroup_folders_its_runtime_folder_lists(tmp_path):
    """v1 (hybrid: cpuacct.usage, whatever else the list holds first) and v2 (cpu.stat); none
    while the sandbox is down or its folders hold neither."""
    runtime, cgroup = tmp_path / "run", tmp_path / "cgroup"

    def listed(name: str, *hierarchies: str) -> None:
        (runtime / name).mkdir(parents=True)
        folders = [cgroup / hierarchy / f"sfsb-{name}" for hierarchy in hierarchies]
        (runtime / name / "cgroups").write_text("".join(f"{folder}\n" for folder in folders))

    def knob(path: str, text: str) -> None:
        (cgroup / path).parent.mkdir(parents=True, exist_ok=True)
        (cgroup / path).write_text(text)

    listed("v1", "pids", "cpu", "cpuacct", "unified")
    knob("pids/sfsb-v1/cgroup.procs", "1\n")
    knob("cpu/sfsb-v1/cpu.stat", "nr_periods 0\nnr_throttled 0\nthrottled_time 0\n")  # v1's: no usage
    knob("cpuacct/sfsb-v1/cpuacct.usage", "2500000000\n")
    knob("unified/sfsb-v1/cpu.stat", "usage_usec 2400000\nuser_usec 2000000\nsystem_usec 400000\n")
    listed("v2", "")
    knob("sfsb-v2/cpu.stat", "usage_usec 1500000\nuser_usec 1000000\nsystem_usec 500000\n")
    listed("bare", "pids")
    knob("pids/sfsb-bare/cgroup.procs", "1\n")
    listed("gone", "cpuacct")  # its folder went with `down`, its runtime folder not yet
    read = {name: sandbox_cpu_s(name, runtime) for name in ("v1", "v2", "bare", "gone", "down")}
    assert read == {"v1": 2.5, "v2": 1.5, "bare": None, "gone": None, "down": None}
    sandboxes, local = cpu_readings(["v1", "v2", "down"], since=local_cpu_s(), runtime_root=runtime)
    assert sandboxes == ("sandbox_cpu_s", {"v1": 2.5, "v2": 1.5})
    assert local[0] == "local_cpu_s" and 0 <= local[1] < 1


def test_the_local_cpu_counts_the_waited_for_children():
    before = local_cpu_s()
    burn = "import time\nwhile time.process_time() < 0.3: pass"
    subprocess.run([sys.executable, "-c", burn], check=True)
    assert local_cpu_s() - before >= 0.3


def test_the_sandboxes_a_test_names_are_its_modules_and_the_pairs(monkeypatch):
    monkeypatch.delenv("SPARKFORM_SANDBOX", raising=False)
    monkeypatch.delenv("SPARKFORM_SANDBOX_PAIR", raising=False)
    assert named_sandboxes() == set()
    monkeypatch.setenv("SPARKFORM_SANDBOX", "t-1")
    monkeypatch.setenv("SPARKFORM_SANDBOX_PAIR", "t-2-head,t-2-worker")
    assert named_sandboxes() == {"t-1", "t-2-head", "t-2-worker"}


def reported(nodeid: str, when: str, worker: str, duration: float, sandboxes=None, local=None):
    """A report as the controller gets it from `worker`, with CPU readings when `local` is given."""
    properties = [] if local is None else [("sandbox_cpu_s", sandboxes or {}), ("local_cpu_s", local)]
    node = SimpleNamespace(gateway=SimpleNamespace(id=worker))
    return SimpleNamespace(nodeid=nodeid, when=when, duration=duration, user_properties=properties, node=node)


def test_each_live_test_is_charged_what_its_sandboxes_and_its_worker_took_since_their_last_reading():
    """A sandbox shared by two modules counts from its last reading, in whichever module; a
    sandbox's first reading counts from its boot; a worker's unit test keeps its share; a
    teardown after the sandboxes went down reads none; a test with no readings has no CPU."""
    a, b = "tests/integration/test_a.py::test_one", "tests/integration/test_b.py::test_two"
    pair, quiet = "tests/integration/test_pair.py::test_reboot", "tests/integration/test_c.py::test_quiet"
    clock = SuiteClock()
    for report in [
        reported(a, "setup", "gw0", 300, {"t-shared": 100}, 10),
        reported(pair, "setup", "gw1", 200, {"t-head": 50, "t-worker": 40}, 5),
        reported(a, "call", "gw0", 50, {"t-shared": 130}, 12),
        reported("tests/unit/test_u.py::test_x", "call", "gw1", 1, {}, 7),
        reported(a, "teardown", "gw0", 1, {"t-shared": 131}, 12.25),
        reported(pair, "call", "gw1", 100, {"t-head": 80, "t-worker": 45}, 9),
        reported(b, "setup", "gw0", 5, {"t-shared": 140}, 13),
        reported(pair, "teardown", "gw1", 30, {}, 10),
        reported(b, "call", "gw0", 60, {"t-shared": 150}, 14),
        reported(quiet, "setup", "gw2", 15),
        reported(quiet, "call", "gw2", 5),
    ]:
        clock.pytest_runtest_logreport(report)
    assert clock.live == {
        a: LiveCost(wall_s=351, sandbox_cpu_s=131, local_cpu_s=12.25),
        b: LiveCost(wall_s=65, sandbox_cpu_s=19, local_cpu_s=1.75),
        pair: LiveCost(wall_s=330, sandbox_cpu_s=125, local_cpu_s=8),
        quiet: LiveCost(wall_s=20),
    }
    cpu = {module: entry.cpu_s for module, entry in clock.modules.items()}
    assert cpu == {
        "tests/integration/test_a.py": 143.25,
        "tests/integration/test_b.py": 20.75,
        "tests/integration/test_pair.py": 133,
        "tests/unit/test_u.py": 2,
        "tests/integration/test_c.py": None,
    }
    assert live_lines(clock.live, wall_s=1000, cores=2) == [
        "  wall s  sandbox cpu s  local cpu s  test",
        "     351            131           12  test_a.py::test_one",
        "     330            125            8  test_pair.py::test_reboot",
        "      65             19            2  test_b.py::test_two",
        "      20              -            -  test_c.py::test_quiet",
        "live tests' CPU: 297 s, 15% of the run's 2000 CPU s (1000 s wall x 2 cores)",
    ]


def test_a_sandbox_brought_up_again_under_its_name_counts_from_its_new_boot():
    test = "tests/integration/test_a.py::test_one"
    clock = SuiteClock()
    for report in [
        reported(test, "setup", "gw0", 10, {"t-again": 50}, 1),
        reported(test, "call", "gw0", 10, {"t-again": 20}, 2),
    ]:
        clock.pytest_runtest_logreport(report)
    assert clock.live[test].sandbox_cpu_s == 70


def test_the_figures_tests_record_are_printed_in_order_once_each():
    figures = SuiteFigures()
    for when, properties in [
        ("setup", [("figure", "not a call")]),
        ("call", [("figure", "a: 1"), ("other", "x")]),
        ("call", [("figure", "b: 2")]),
    ]:
        figures.pytest_runtest_logreport(SimpleNamespace(when=when, user_properties=properties))
    written = []
    reporter = SimpleNamespace(section=lambda title: written.append(f"== {title}"), write_line=written.append)
    figures.pytest_terminal_summary(reporter)
    assert written == ["== figures the tests measured", "a: 1", "b: 2"]


def test_a_module_over_its_budget_by_a_third_is_named_and_one_within_it_is_not():
    modules = {
        name: ModuleTime() for name in ("tests/integration/slow.py", "tests/integration/fine.py", "tests/unit/x.py")
    }
    modules["tests/integration/slow.py"].seconds["call"] = 10 * 60 * 4 / 3 + 1
    modules["tests/integration/fine.py"].seconds["call"] = 10 * 60 * 4 / 3 - 1
    modules["tests/unit/x.py"].seconds["call"] = 3600
    budgets = {"tests/integration/slow.py": 10, "tests/integration/fine.py": 10}
    (warning,) = over_budget(modules, budget_of=budgets.get)
    assert warning.startswith("WARNING: tests/integration/slow.py took 13.3 min, over its budget of 10 min")


def test_every_integration_module_declares_a_budget_the_warning_reads():
    modules = sorted(Path(__file__).resolve().parents[1].glob("integration/test_*.py"))
    assert modules
    for module in modules:
        assert isinstance(declared(f"tests/integration/{module.name}").get("CI_MINUTES"), (int, float)), module.name


def sampled(*readings: float) -> tuple[MemoryPeak, threading.Event]:
    """A MemoryPeak over these MemAvailable readings, the last repeated; the event is set once
    the sampler took them all."""
    left, taken = list(readings), threading.Event()

    def sample() -> float:
        if len(left) == 1:
            taken.set()
            return left[0]
        return left.pop(0)

    return MemoryPeak(sample=sample, interval_s=0.01), taken


def test_the_memory_peak_is_the_lowest_mem_available_below_the_start():
    peak, taken = sampled(20.0, 18.5, 9.0, 15.0)
    assert taken.wait(10), "the sampler stopped sampling"
    peak.stop()
    assert peak.peak_gib == 11.0
    assert peak.lines()[0].startswith("peak memory of the suite: 11.0 GiB (MemAvailable 20.0 GiB at the start")
    assert len(peak.lines()) == 1  # within the budget: no warning
    over, taken = sampled(20.0, 5.0)
    assert taken.wait(10), "the sampler stopped sampling"
    over.stop()
    assert over.peak_gib == 15.0
    assert "WARNING: over the suite's 12 GiB" in over.lines()[1]


def test_the_memory_peak_names_the_tests_that_ran_at_its_lowest():
    readings = iter([20.0, 18.0])
    hold, lowest = threading.Event(), threading.Event()

    def sample() -> float:
        value = next(readings, None)
        if value is None:
            lowest.set()
            return 19.0
        if value == 18.0:
            hold.wait(10)
        return value

    peak = MemoryPeak(sample=sample, interval_s=0.01)
    peak.pytest_runtest_logstart("tests/a.py::done_before", ("a", 1, "done_before"))
    peak.pytest_runtest_logfinish("tests/a.py::done_before", ("a", 1, "done_before"))
    for nodeid in ("tests/b.py::hog", "tests/a.py::beside"):
        peak.pytest_runtest_logstart(nodeid, ("x", 1, nodeid))
    hold.set()  # the lowest reading comes while those two run
    assert lowest.wait(10), "the sampler stopped sampling"
    peak.pytest_runtest_logfinish("tests/b.py::hog", ("b", 1, "hog"))
    peak.stop()
    assert peak.lines()[1] == "at its lowest, these tests ran: tests/a.py::beside, tests/b.py::hog"


def test_sandbox_slots_let_at_most_their_number_up_at_once(tmp_path, monkeypatch):
    """A second holder of the only slot waits until the first lets it go; a demand larger than
    the slots is refused."""
    monkeypatch.setattr(suite_memory, "SLOT", tmp_path / "slot.{}")
    monkeypatch.setattr(suite_memory, "SLOT_POLL_S", 0.01)
    order = []
    first_in = threading.Event()
    release = threading.Event()

    def holder(name, wait_for=None):
        with suite_memory.sandbox_slots(1, slots=1):
            order.append(f"{name} in")
            first_in.set()
            if wait_for:
                wait_for.wait(10)
            order.append(f"{name} out")

    first = threading.Thread(target=holder, args=("first", release))
    first.start()
    first_in.wait(10)
    second = threading.Thread(target=holder, args=("second",))
    second.start()
    second.join(0.2)
    assert order == ["first in"]  # the second waits while the first holds the slot
    release.set()
    first.join(10)
    second.join(10)
    assert order == ["first in", "first out", "second in", "second out"]
    with pytest.raises(ValueError, match="2 sandboxes at once"):
        with suite_memory.sandbox_slots(2, slots=1):
            pass
