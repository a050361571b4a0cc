"""The pieces of a rebuild that run without a host: the record script (with a stand-in
systemctl), the record the deploy plans, the boot chain check and rebuild's start table."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from sparkform.commands.rebuild import start_table
from sparkform.readers.hostrecord import EngineRecord, HostRecord, HostVersions, cache_key, engine_cache_keys
from sparkform.readers.parsers import EngineState
from sparkform.readers.snapshot import Snapshot
from sparkform.rules.bootchain import holes as boot_chain_holes
from sparkform.rules.inventory import load_host
from sparkform.writers.converge import planned_record
from sparkform.writers.render import render_host

VERSIONS = HostVersions(kernel="6.11", driver="580.95.05", cuda="13.0", gpu_arch="12.1", vllm="vllm-0.27.1")
KEY = cache_key(VERSIONS)
# What `systemctl show --timestamp=unix` prints for an engine that started at 1764400000 and
# served 41.25 s later (monotonic microseconds).
SHOW_ACTIVE = (
    "ExecMainStartTimestamp=@1764400000\nExecMainStartTimestampMonotonic=5000000\n"
    "ActiveEnterTimestampMonotonic=46250000\nActiveState=active\n"
)


def config():
    return load_host(
        "box",
        {
            "engines": [
                {"name": "a", "port": 8010, "checkpoint": {"repo": "o/a", "revision": "main"}},
                {"name": "b", "port": 8001, "checkpoint": {"repo": "o/b", "revision": "main"}, "after": ["a"]},
            ]
        },
    ).config


def keys(cfg, live):
    """Each engine's cache key as the converge plan gives planned_record them."""
    return engine_cache_keys(live, {e.name: cfg.pin(e).label for e in cfg.enabled_engines})


def run_record_script(tmp_path: Path, show: str, *args: str) -> subprocess.CompletedProcess:
    script = next(f for f in render_host(config()) if f.path.endswith("/sparkform-record"))
    (tmp_path / "sparkform-record").write_text(script.content)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "systemctl").write_text(f"#!/bin/sh\nprintf '%s' '{show}'\n")
    (bin_dir / "systemctl").chmod(0o755)
    planned = HostRecord(VERSIONS, {"a": EngineRecord(KEY, 200.0, 30.0, 1.0, False), "b": EngineRecord(KEY)})
    return subprocess.run(
        [sys.executable, str(tmp_path / "sparkform-record"), str(tmp_path / "record.json"), planned.to_json(), *args],
        capture_output=True,
        text=True,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin"},
    )


def test_record_script_measures_the_starts_it_is_told_about(tmp_path):
    result = run_record_script(tmp_path, SHOW_ACTIVE, "b=vllm-b.service:cold")
    assert result.returncode == 0, result.stderr
    written = HostRecord.from_json((tmp_path / "record.json").read_text())
    assert written.engines["b"] == EngineRecord(KEY, 41.2, 41.2, 1764400000.0, True)
    assert written.engines["a"] == EngineRecord(KEY, 200.0, 30.0, 1.0, False)  # not started: as planned
    assert oct((tmp_path / "record.json").stat().st_mode & 0o777) == "0o644"


def test_record_script_refuses_an_engine_that_is_not_active(tmp_path):
    result = run_record_script(tmp_path, SHOW_ACTIVE.replace("=active", "=failed"), "a=vllm-a.service")
    assert result.returncode == 3 and "vllm-a.service is failed" in result.stderr
    assert not (tmp_path / "record.json").exists()


def test_planned_record_takes_systemds_boot_start_and_keeps_the_cold_start():
    old = HostRecord(VERSIONS, {"a": EngineRecord(KEY, 200.0, 30.0, 1000.0, True)})
    snapshot = Snapshot(
        engines={
            "vllm-a.service": EngineState(
                "vllm-a.service", "active", "running", 0, 42, 0, "success", "enabled", started_at=2000.0, start_s=33.5
            ),
            "vllm-b.service": EngineState(
                "vllm-b.service", "active", "running", 0, 43, 0, "success", "enabled", started_at=2001.0, start_s=12.0
            ),
        }
    )
    live = HostVersions(**{**VERSIONS.__dict__, "driver": "580.126.09"})
    planned = planned_record(config(), live, keys(config(), live), old, snapshot)
    assert planned.versions == live
    assert planned.engines["a"] == EngineRecord(cache_key(live), 200.0, 33.5, 2000.0, False)
    assert planned.engines["b"] == EngineRecord(cache_key(live), None, 12.0, 2001.0, False)
    # Nothing new since the record: the planned record equals it, so the deploy writes nothing.
    same = planned_record(config(), live, keys(config(), live), planned, snapshot)
    assert same == planned


def test_boot_chain_holes_are_edges_to_engine_units_that_are_not_enabled():
    after = {
        "vllm-b.service": ("network-online.target", "vllm-a.service", "vllm-gone.service"),
        "vllm-a.service": ("network-online.target",),
    }
    unit_files = {"vllm-a.service": "disabled", "vllm-b.service": "enabled"}
    assert boot_chain_holes(after, unit_files) == [
        ("vllm-b.service", "vllm-a.service", "disabled"),
        ("vllm-b.service", "vllm-gone.service", "missing"),
    ]
    assert boot_chain_holes(after, {**unit_files, "vllm-a.service": "enabled", "vllm-gone.service": "enabled"}) == []


def test_start_table_tells_new_starts_from_engines_that_kept_running():
    before = HostRecord(
        VERSIONS,
        {"a": EngineRecord(KEY, 200.0, 30.0, 1000.0, False), "b": EngineRecord(KEY, 335.0, 20.0, 1001.0, False)},
    )
    after = HostRecord(
        VERSIONS,
        {"a": EngineRecord(KEY, 210.4, 210.4, 2000.0, True), "b": EngineRecord(KEY, 335.0, 20.0, 1001.0, False)},
    )
    rows = [line.split("  ") for line in start_table(before, after).splitlines()]
    cells = [[cell.strip() for cell in row if cell.strip()] for row in rows]
    assert cells[0] == ["engine", "this start", "kind", "recorded cold start", "recorded last start"]
    assert cells[1] == ["a", "210.4 s", "cold", "200.0 s", "30.0 s"]
    assert cells[2] == ["b", "-", "kept running", "335.0 s", "20.0 s"]
    (header_only,) = start_table(None, None).splitlines()  # no record: the header only
    assert [cell.strip() for cell in header_only.split("  ") if cell.strip()] == cells[0]


def test_planned_record_keeps_the_boot_start_through_systemds_own_restarts():
    # Booted at 1900; the record has this boot's start (2000). systemd restarted the engine at
    # 2500 after a crash: not a change to converge, so the planned record is the record.
    booted = HostRecord(
        VERSIONS,
        {"a": EngineRecord(KEY, 200.0, 30.0, 2000.0, False), "b": EngineRecord(KEY, None, 12.0, 2001.0, False)},
    )
    snapshot = Snapshot(
        booted_at=1900.0,
        engines={
            "vllm-a.service": EngineState(
                "vllm-a.service", "active", "running", 1, 42, 0, "success", "enabled", started_at=2500.0, start_s=31.0
            ),
            "vllm-b.service": EngineState(
                "vllm-b.service", "active", "running", 0, 43, 0, "success", "enabled", started_at=2001.0, start_s=12.0
            ),
        },
    )
    assert planned_record(config(), VERSIONS, keys(config(), VERSIONS), booted, snapshot) == booted
    # After the next boot (3000) the first start is the boot's, and it is recorded.
    snapshot.booted_at = 3000.0
    snapshot.engines["vllm-a.service"] = replace(snapshot.engines["vllm-a.service"], started_at=3010.0)
    assert (
        planned_record(config(), VERSIONS, keys(config(), VERSIONS), booted, snapshot).engines["a"].started_at == 3010.0
    )
