"""Parsers against captured output of each vLLM, nvidia-smi, meminfo and systemctl format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from samples import engine_state

from sparkform.readers.parsers import (
    Gpu,
    GpuReport,
    KvPool,
    cuda_version_from_nvidia_smi,
    engine_states,
    parse_gpu_report,
    parse_kv_pool,
    parse_meminfo,
    parse_nvidia_smi_csv,
    parse_systemctl_show,
    parse_vllm_version,
)

CAPTURED = Path(__file__).resolve().parent.parent / "fixtures" / "captured"


def captured(name: str) -> list[str]:
    return (CAPTURED / name).read_text().splitlines()


# --- parse_kv_pool ---------------------------------------------------------------------------


def test_kv_pool_two_line_format_of_0_27():
    assert parse_kv_pool(captured("vllm-0.27-two-line.log")) == KvPool(
        device="GPU", tokens=2_703_604, max_model_len=262_144, concurrency=10.31, available_gib=8.26
    )


def test_kv_pool_one_line_format_of_0_29():
    assert parse_kv_pool(captured("vllm-0.29-one-line.log")) == KvPool(
        device="GPU", tokens=858_483, max_model_len=262_144, concurrency=3.27, available_gib=26.8
    )


def test_kv_pool_cpu_line_of_0_32_has_no_available_memory():
    assert parse_kv_pool(captured("vllm-0.32-cpu.log")) == KvPool(
        device="CPU", tokens=1_048_576, max_model_len=2_048, concurrency=512.0, available_gib=None
    )


def test_kv_pool_latest_of_three_boots_in_journal_output():
    # Boot 1 at 131K, boot 2 died after "Available", boot 3 at 262K: boot 3 is the answer.
    assert parse_kv_pool(captured("vllm-0.33-journal-three-boots.log")) == KvPool(
        device="GPU", tokens=2_703_604, max_model_len=262_144, concurrency=10.31, available_gib=8.26
    )


@pytest.mark.parametrize("device_words", ["GPU + host", "GPU+host", "GPU  +  host"])
def test_kv_pool_0_33_host_suffix_keeps_the_device_word(device_words):
    line = (
        "(EngineCore pid=2488) INFO 08-20 09:17:30 [kv_cache_utils.py:1311] "
        f"{device_words} KV cache size: 3,145,728 tokens, "
        "Maximum concurrency for 262,144 tokens per request: 12.00x"
    )
    pool = parse_kv_pool(["Available KV cache memory: 8.26 GiB", line])
    assert pool == KvPool(device="GPU", tokens=3_145_728, max_model_len=262_144, concurrency=12.0, available_gib=8.26)


def test_kv_pool_xpu_line():
    pool = parse_kv_pool(
        [
            (
                "INFO 08-20 12:00:01 [kv_cache_utils.py:1311] XPU KV cache size: 65,536 tokens, "
                "Maximum concurrency for 8,192 tokens per request: 8.00x"
            )
        ]
    )
    assert (pool.device, pool.tokens, pool.max_model_len, pool.concurrency) == ("XPU", 65_536, 8_192, 8.0)


def test_kv_pool_two_line_boots_return_the_last():
    lines = [
        "INFO 08-19 20:01:10 [kv_cache_utils.py:1087] GPU KV cache size: 2,777,998 tokens",
        ("INFO 08-19 20:01:10 [kv_cache_utils.py:1091] Maximum concurrency for 131,072 tokens per request: 21.20x"),
        "INFO 08-20 09:15:41 [kv_cache_utils.py:1087] GPU KV cache size: 2,703,604 tokens",
        ("INFO 08-20 09:15:41 [kv_cache_utils.py:1091] Maximum concurrency for 262,144 tokens per request: 10.31x"),
    ]
    pool = parse_kv_pool(lines)
    assert (pool.tokens, pool.max_model_len, pool.concurrency) == (2_703_604, 262_144, 10.31)


def test_kv_pool_prefers_the_last_complete_pool_over_a_cut_off_one():
    lines = [
        "GPU KV cache size: 2,777,998 tokens",
        "Maximum concurrency for 131,072 tokens per request: 21.20x",
        "GPU KV cache size: 2,703,604 tokens",
    ]
    assert parse_kv_pool(lines).tokens == 2_777_998


def test_kv_pool_orphan_concurrency_line_does_not_rewrite_a_complete_pool():
    lines = [
        "GPU KV cache size: 2,703,604 tokens",
        "Maximum concurrency for 262,144 tokens per request: 10.31x",
        "Maximum concurrency for 131,072 tokens per request: 21.20x",
    ]
    pool = parse_kv_pool(lines)
    assert (pool.max_model_len, pool.concurrency) == (262_144, 10.31)


def test_kv_pool_size_without_concurrency_when_nothing_completed():
    assert parse_kv_pool(["GPU KV cache size: 2,703,604 tokens"]) == KvPool(
        device="GPU", tokens=2_703_604, max_model_len=None, concurrency=None, available_gib=None
    )


def test_kv_pool_on_a_grep_filtered_journal():
    # The journal cut down to the lines the parser reads: the pool, the memory, the boot marker.
    wanted = ("KV cache size:", "Maximum concurrency for", "Available KV cache memory:", "vLLM API server version")
    lines = [line for line in captured("vllm-0.33-journal-three-boots.log") if any(text in line for text in wanted)]
    assert parse_kv_pool(lines) == KvPool(
        device="GPU", tokens=2_703_604, max_model_len=262_144, concurrency=10.31, available_gib=8.26
    )


def test_vllm_version_of_the_latest_start_in_either_form():
    # <= 0.29: the API server's line; 0.32 (the sandbox's journal, verbatim up to the config): only
    # its ASCII banner and the EngineCore's first line, which is what counts.
    older = "INFO 08-20 09:14:02 [api_server.py:2012] vLLM API server version 0.29.0"
    banner = "(APIServer pid=1059) INFO 12-01 09:15:45 [api_utils.py:347]  ▄▄ ▄█ █     █     █ ▀▄▀ █  version 0.31.9"
    engine = (
        "(EngineCore pid=1259) INFO 12-01 09:16:03 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with "
        "config: model='/var/lib/sparkform/models/sparkform-test--tiny-llama@afb0a669', speculative_config=None"
    )
    assert parse_vllm_version([older, banner, engine]) == "0.32.0"
    assert parse_vllm_version([older, banner]) == "0.29.0"
    assert parse_vllm_version([banner]) is None


def test_kv_pool_does_not_carry_available_memory_across_boots():
    # Boot 1 logged "Available" then died; boot 2 ran with --kv-cache-memory-bytes (no line).
    lines = [
        "INFO 08-20 09:14:02 [api_server.py:2012] vLLM API server version 0.33.0",
        ("(EngineCore pid=2290) INFO 08-20 09:15:40 [gpu_worker.py:361] Available KV cache memory: 8.31 GiB"),
        "INFO 08-20 09:15:52 [api_server.py:2012] vLLM API server version 0.33.0",
        (
            "(EngineCore pid=2488) INFO 08-20 09:17:30 [kv_cache_utils.py:1311] GPU KV cache size: "
            "2,703,604 tokens, Maximum concurrency for 262,144 tokens per request: 10.31x"
        ),
    ]
    assert parse_kv_pool(lines).available_gib is None


@pytest.mark.parametrize(
    "lines",
    [
        [],
        ["INFO 08-20 09:14:02 [api_server.py:2012] vLLM API server version 0.33.0"],
        ["Maximum concurrency for 262,144 tokens per request: 10.31x"],
        ["KV cache size: lots", "\x00\xff garbage", "GPU KV cache size: tokens"],
    ],
)
def test_kv_pool_none_without_a_size_line(lines):
    assert parse_kv_pool(lines) is None


# --- parse_meminfo ---------------------------------------------------------------------------


def test_meminfo_gb10():
    memory = parse_meminfo(captured("meminfo-gb10.txt"))
    assert memory["mem_total_kib"] == 127_210_532
    assert memory["mem_available_kib"] == 21_478_364
    assert memory["mem_total_gib"] == pytest.approx(121.32, abs=0.01)
    assert memory["mem_available_gib"] == pytest.approx(20.48, abs=0.01)


def test_meminfo_missing_lines_read_none():
    assert parse_meminfo(["MemFree: 3918204 kB"]) == {
        "mem_total_kib": None,
        "mem_available_kib": None,
        "mem_total_gib": None,
        "mem_available_gib": None,
    }


# --- nvidia-smi ------------------------------------------------------------------------------


def test_nvidia_smi_gb10_memory_not_available():
    assert parse_nvidia_smi_csv(captured("nvidia-smi-query-gb10.csv")) == [
        Gpu(
            name="NVIDIA GB10",
            driver_version="580.95.05",
            memory_total_mib=None,
            memory_used_mib=None,
            compute_cap="12.1",
        )
    ]


@pytest.mark.parametrize("unavailable", ["[N/A]", "N/A", "Not Supported", "[Not Supported]"])
def test_nvidia_smi_every_unavailable_spelling_reads_none(unavailable):
    (gpu,) = parse_nvidia_smi_csv([f"NVIDIA GB10, 580.95.05, {unavailable}, {unavailable}, 12.1"])
    assert (gpu.memory_total_mib, gpu.memory_used_mib) == (None, None)


def test_nvidia_smi_discrete_gpus():
    lines = [
        "NVIDIA H100 80GB HBM3, 570.133.20, 81559, 1024, 9.0",
        "NVIDIA RTX 6000 Ada Generation, 570.133.20, 49140, 3, 8.9",
    ]
    assert parse_nvidia_smi_csv(lines) == [
        Gpu("NVIDIA H100 80GB HBM3", "570.133.20", 81559, 1024, "9.0"),
        Gpu("NVIDIA RTX 6000 Ada Generation", "570.133.20", 49140, 3, "8.9"),
    ]


def test_nvidia_smi_skips_non_rows():
    lines = [
        (
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
            "Make sure that the latest NVIDIA driver is installed and running."
        ),
        "",
        "a, b, c",
    ]
    assert parse_nvidia_smi_csv(lines) == []


def test_cuda_version_from_banner():
    assert cuda_version_from_nvidia_smi(captured("nvidia-smi-gb10.txt")) == "13.0"


def test_cuda_version_none_without_banner():
    assert cuda_version_from_nvidia_smi(captured("nvidia-smi-query-gb10.csv")) is None


def test_gpu_report_from_rows_and_banner_together():
    banner = "| NVIDIA-SMI 580.95.05   Driver Version: 580.95.05   CUDA Version: 13.0 |"
    lines = [*captured("nvidia-smi-query-gb10.csv"), banner]
    report = parse_gpu_report(lines)
    assert report.cuda_version == "13.0"
    assert [gpu.name for gpu in report.gpus] == ["NVIDIA GB10"]


def test_gpu_report_gb10_rows_and_banner():
    banner = [line for line in captured("nvidia-smi-gb10.txt") if "CUDA Version" in line]
    report = parse_gpu_report(captured("nvidia-smi-query-gb10.csv") + banner)
    assert report.cuda_version == "13.0"
    assert report.gpus == (Gpu("NVIDIA GB10", "580.95.05", None, None, "12.1"),)


def test_gpu_report_of_nothing_is_empty():
    # No nvidia-smi, or one that cannot reach the driver: no GPUs, no CUDA version.
    assert parse_gpu_report([]) == GpuReport() == GpuReport(gpus=(), cuda_version=None)


# --- systemctl show --------------------------------------------------------------------------


def test_systemctl_show_blocks_by_unit_id_whatever_the_property_order():
    units = parse_systemctl_show(captured("systemctl-show-two-units.txt"))
    assert set(units) == {"vllm-nemotron.service", "vllm-qwen38.service"}
    assert units["vllm-nemotron.service"]["MainPID"] == "2402"
    assert units["vllm-nemotron.service"]["SubState"] == "running"
    assert units["vllm-qwen38.service"]["LoadState"] == "not-found"
    assert units["vllm-qwen38.service"]["UnitFileState"] == ""


def test_systemctl_show_keeps_equals_in_values_and_drops_blocks_without_id():
    units = parse_systemctl_show(["Id=a.service", "Description=x=y", "", "MainPID=7", ""])
    assert units == {"a.service": {"Id": "a.service", "Description": "x=y"}}


def test_engine_states_running_and_not_found_units():
    states = engine_states(captured("systemctl-show-two-units.txt"))
    # A running engine (engine_state's defaults: active, enabled), loaded and restarted once.
    assert states["vllm-nemotron.service"] == engine_state(
        "vllm-nemotron.service", n_restarts=1, main_pid=2402, load_state="loaded"
    )
    assert states["vllm-nemotron.service"].exists
    missing = states["vllm-qwen38.service"]
    assert not missing.exists and missing.load_state == "not-found"
    assert (missing.active_state, missing.main_pid, missing.unit_file_state) == ("inactive", 0, "")


def test_engine_states_unset_numbers_read_zero():
    (state,) = engine_states(
        [
            "Id=vllm-x.service",
            "NRestarts=[not set]",
            "MainPID=",
            "ExecMainStatus=1",
            "Result=exit-code",
            "ActiveState=failed",
            "SubState=failed",
        ]
    ).values()
    assert (state.n_restarts, state.main_pid, state.exec_main_status) == (0, 0, 1)
    assert state.result == "exit-code"


# --- as pyinfra prints them --------------------------------------------------------------------


def to_json(value: object) -> object:
    return value.to_json()


def test_values_serialize_for_the_pyinfra_cli():
    # pyinfra_cli's JSON encoder calls to_json() on what it prints (not imported here:
    # pyinfra_cli monkey-patches ssl with gevent).
    report = parse_gpu_report(captured("nvidia-smi-query-gb10.csv"))
    assert json.loads(json.dumps(report, default=to_json)) == {
        "gpus": [
            {
                "name": "NVIDIA GB10",
                "driver_version": "580.95.05",
                "memory_total_mib": None,
                "memory_used_mib": None,
                "compute_cap": "12.1",
            }
        ],
        "cuda_version": None,
    }
    states = engine_states(captured("systemctl-show-two-units.txt"))
    encoded = json.loads(json.dumps(states, default=to_json))
    assert encoded["vllm-qwen38.service"]["load_state"] == "not-found"


@pytest.mark.parametrize(
    "start_line",
    [
        "INFO 08-20 09:15:30 [api_server.py:1805] vLLM API server version 0.29.0",  # <= 0.29
        "(EngineCore pid=1807) INFO 12-01 09:18:01 [core.py:97] Initializing a V1 LLM engine (v0.32.0) with config: ",
    ],
)
def test_kv_pool_drops_the_stale_available_memory_of_a_start_that_died(start_line):
    """A start that printed its available memory and died: the next start's pool (a device that
    prints no such line) does not take that stale figure."""
    lines = [
        start_line,
        "INFO 08-20 09:15:40 [gpu_worker.py:298] Available KV cache memory: 8.26 GiB",
        start_line,
        "INFO 08-20 09:16:41 [kv_cache_utils.py:1087] CPU KV cache size: 65,536 tokens, "
        "Maximum concurrency for 2,048 tokens per request: 32.00x",
    ]
    pool = parse_kv_pool(lines)
    assert pool is not None and pool.tokens == 65_536 and pool.available_gib is None
    assert parse_kv_pool([lines[0], lines[1], lines[3]]).available_gib == 8.26  # one start: its own figure
