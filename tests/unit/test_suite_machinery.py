"""The suite's own machinery: the machine-state check finds what a test left outside its folders,
a killed run's sandboxes and temp folders are cleared by their names (and nothing else), a run
clears only while no other run holds the run lock, the time table adds up by module."""

from __future__ import annotations

import fcntl
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import suite_hygiene
from suite_clock import ModuleTime, table
from suite_figures import SuiteFigures
from suite_hygiene import SANDBOX_NAME, changes, entries, leftover_sandboxes, sandbox_name

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
    lines = table(modules, 400.0)
    assert lines[1].split() == ["tests/integration/test_a.py", "3", "200", "150", "0", "350", "gw0"]
    assert lines[2].split() == ["tests/unit/test_b.py", "2", "0", "4", "0", "4", "gw0,gw1"]
    # Each worker's sum is what its reports took: gw0 350 + 1, gw1 3.
    assert lines[3:] == ["worker gw0: 351 s of tests", "worker gw1: 3 s of tests", "wall time: 400 s (6.7 min)"]


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
