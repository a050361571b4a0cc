"""Shared fixtures for sparkform's unit tests.

`seed_data` is the owner's served pair (docs/incidents.md#the-served-pair; "seed" in test names:
the pair sparkform was first built for) as host data, read from its frozen copy
tests/fixtures/inventories/served_pair.py (the owner edits inventory/spark.py); `make_host`
validates host data the way an inventory does (config.json paths resolve against
tests/fixtures/model_configs); `problems_of` returns every Problem of invalid data.
"""

from __future__ import annotations

import copy
import functools
import os
import secrets
import shutil
import socket
from pathlib import Path
from typing import Any, Callable

import pytest
from chains import ChainScheduler
from suite_clock import SuiteClock, cpu_readings, local_cpu_s, named_sandboxes
from suite_figures import SuiteFigures
from suite_hygiene import TEMP_PREFIX, MachineState, clear_leftovers, hold_run_lock, temp_folder
from suite_memory import MemoryPeak, available_gib

from sparkform.domain.model import Host, InventoryError, Problem
from sparkform.rules.inventory import load_host, raw_inventory

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
MODEL_CONFIGS = FIXTURES / "model_configs"

SERVED_PAIR = FIXTURES / "inventories" / "served_pair.py"  # tests/unit/samples.py names it too
MEASURED_ON_THE_BOX = ("measured", "weights_gib")  # tests derive these from the fixtures' config.json


@functools.cache
def served_pair() -> dict[str, Any]:
    """The served pair's host data, without what was measured on the box."""
    (spark,) = raw_inventory(SERVED_PAIR).values()
    engines = [{k: v for k, v in engine.items() if k not in MEASURED_ON_THE_BOX} for engine in spark["engines"]]
    return {"vllm_version": spark["vllm_version"], "engines": engines}


def pytest_configure(config):
    """The run's machinery (in the controller, before any xdist worker starts): the remains of a
    killed earlier run cleared, the time per module, the figures tests measured, the machine's
    state and the memory the run holds watched (suite_clock, suite_figures, suite_hygiene,
    suite_memory), and xdist's work units made chains (chains.py).

    The served pair (and inventory/spark.py) serves the LAN and so names an API key file, and pins the Spark's host
    key: give it both for the session, unless the caller set them (xdist's workers inherit them)."""
    if not hasattr(config, "workerinput"):
        config.sparkform_run_lock, alone = hold_run_lock()
        if alone:
            for gone in clear_leftovers():
                print(f"cleared what a killed run left: {gone}")
        config.pluginmanager.register(SuiteClock(), "sparkform-suite-clock")
        config.pluginmanager.register(SuiteFigures(), "sparkform-suite-figures")
        config.pluginmanager.register(MachineState(), "sparkform-machine-state")
        config.pluginmanager.register(MemoryPeak(), "sparkform-memory-peak")
        if config.pluginmanager.hasplugin("xdist"):
            config.pluginmanager.register(ChainScheduler(), "sparkform-chains")
    if "SPARK_API_KEY_FILE" not in os.environ:
        path = temp_folder("key") / "spark-api-key"
        path.write_text(f"{secrets.token_hex(32)}\n")
        path.chmod(0o600)
        os.environ["SPARK_API_KEY_FILE"] = str(path)
    # It also pins the Spark's SSH host key: a recorded key (no test connects to it).
    if "SPARK_KNOWN_HOSTS" not in os.environ:
        path = temp_folder("known-hosts") / "known_hosts"
        path.write_text("spark.local ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKtestkeytestkeytestkeytestkeytestkeytest\n")
        os.environ["SPARK_KNOWN_HOSTS"] = str(path)


CPU_AT_START = pytest.StashKey[float]()
SANDBOXES_NAMED = pytest.StashKey[set[str]]()


def pytest_collection_finish(session):
    """The CPU this process spent starting and collecting is no test's: tests' CPU counts from here."""
    session.config.stash[CPU_AT_START] = local_cpu_s()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Every report carries the CPU readings the suite clock charges its test (suite_clock.py).

    A failure says how loaded the machine was at that moment: a wait that ran out under load
    reads differently from one that ran out on a quiet machine."""
    outcome = yield
    report = outcome.get_result()
    # Every sandbox the test named in any phase: a module's last teardown runs after `box` and
    # `pair` unset their variables, and a sandbox that outlives it (the shared one) is read still.
    named = item.stash.setdefault(SANDBOXES_NAMED, set())
    named |= named_sandboxes()
    # A list of the report's own: its user_properties is the item's, which every phase shares.
    readings = cpu_readings(named, since=item.config.stash.get(CPU_AT_START, 0.0))
    report.user_properties = [*report.user_properties, *readings]
    if report.failed:
        load = " ".join(f"{value:.1f}" for value in os.getloadavg())
        report.sections.append(
            (
                "machine at the failure",
                f"load average {load} on {os.cpu_count()} cores; MemAvailable {available_gib():.1f} GiB",
            )
        )


def pytest_unconfigure(config):
    """The session's temp folders go with the run that made them (the controller's)."""
    if hasattr(config, "workerinput"):
        return
    for variable in ("SPARK_API_KEY_FILE", "SPARK_KNOWN_HOSTS"):
        folder = Path(os.environ.get(variable, "")).parent
        if folder.name.startswith(TEMP_PREFIX):
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def seed_data() -> dict[str, Any]:
    """A fresh, valid copy of the served pair's host data (mutate it freely)."""
    return copy.deepcopy(served_pair())


@pytest.fixture
def make_host() -> Callable[..., Host]:
    def _make(data: dict[str, Any], name: str = "spark", base_dir: Path = MODEL_CONFIGS) -> Host:
        return load_host(name, data, base_dir)

    return _make


@pytest.fixture
def problems_of() -> Callable[..., list[Problem]]:
    """The problems load_host reports for `data`; fails the test when the data is valid."""

    def _problems(data: dict[str, Any], name: str = "spark", base_dir: Path = MODEL_CONFIGS) -> list[Problem]:
        try:
            load_host(name, data, base_dir)
        except InventoryError as err:
            assert err.problems, "InventoryError without problems"
            return err.problems
        pytest.fail("the data was accepted, but it is invalid")

    return _problems


@pytest.fixture
def free_port() -> Callable[[], int]:
    """A TCP port on 127.0.0.1 that nothing listens on (at the time of the call)."""

    def _port() -> int:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]

    return _port
