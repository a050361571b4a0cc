"""Values that several unit-test modules build alike: the served pair's inventory, the Spark's
versions as its host record holds them, and the systemd state of an engine unit (an EngineState as
the snapshot fact reads one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sparkform.hostrecord import HostVersions
from sparkform.parsers import EngineState

# The owner's pair as inventory/spark.py shipped it: what the tests read instead of that file.
SERVED_PAIR = Path(__file__).resolve().parents[1] / "fixtures" / "inventories" / "served_pair.py"

# The owner's Spark (GB10), as its live-versions probe reports it: kernel, driver, the driver's CUDA,
# GPU architecture, firmware, and the vLLM package-version its inventory configures.
SPARK_VERSIONS = HostVersions("6.11.0-1016-nvidia", "580.95.05", "13.0", "12.1", "5.36_0ACUM018", "vllm-0.27.1")


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
