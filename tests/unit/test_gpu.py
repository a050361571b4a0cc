"""The GPU report: NVML_REPORT run for real (pynvml, and the sandbox's NVML stand-in compiled here
in place of libnvidia-ml.so.1), and its parser against good, NOT_SUPPORTED and hostile reports."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pynvml
import pytest

from sparkform.host import nvml_report
from sparkform.readers import gpu
from sparkform.readers.gpu import NvmlGpu, NvmlReport, NvmlReportError, parse_nvml_report
from sparkform.sandbox import stage

GB10 = stage.DEFAULT_NVIDIA_ENV


def write_env(path: Path, **changes: str) -> Path:
    """The stand-ins' env file with `changes` over the GB10's values."""
    path.write_text(stage.nvidia_env_text({**GB10, **changes}))
    return path


def run_report(library_path: Path | str, env_file: Path, *python_options: str) -> subprocess.CompletedProcess[str]:
    """NVML_REPORT run by this venv's python (which has pynvml), as `sparkform status` runs it."""
    env = {**os.environ, "LD_LIBRARY_PATH": str(library_path), "SPARKFORM_NVIDIA_ENV": str(env_file)}
    if python_options:
        argv = [sys.executable, *python_options, "-c", gpu.NVML_REPORT]
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    command = gpu.report_command(sys.executable)
    return subprocess.run(command, shell=True, capture_output=True, text=True, env=env, timeout=60)


def gb10_reading(**changes: object) -> NvmlGpu:
    values = {
        "index": 0,
        "name": GB10["GPU_NAME"],
        "utilization_percent": int(GB10["GPU_UTILIZATION_PERCENT"]),
        "sm_clock_mhz": int(GB10["SM_CLOCK_MHZ"]),
        "temperature_c": int(GB10["GPU_TEMPERATURE_C"]),
        "power_w": int(GB10["GPU_POWER_MW"]) / 1000,
        "throttle_reasons": (),
        "memory_used_bytes": None,
    }
    return NvmlGpu(**{**values, **changes})


# --- the stand-in's values are the captured GB10's ------------------------------------------------


def test_the_stand_ins_readings_are_the_captured_gb10s():
    captured = (Path(__file__).resolve().parent.parent / "fixtures/captured/nvidia-smi-gb10.txt").read_text()
    load = captured.splitlines()[9].split()  # | N/A 44C P0 12W / N/A | Not Supported | 3% Default |
    assert (load[2], load[4], load[11]) == ("44C", "12W", "3%")
    assert GB10["GPU_TEMPERATURE_C"] == "44" and GB10["GPU_UTILIZATION_PERCENT"] == "3"
    assert int(GB10["GPU_POWER_MW"]) // 1000 == 12
    assert f"Driver Version: {GB10['DRIVER_VERSION']}" in captured and GB10["GPU_NAME"] in captured


# --- NVML_REPORT, run for real ------------------------------------------------------------------


def test_the_report_reads_a_gb10(nvml_lib, tmp_path):
    result = run_report(nvml_lib, write_env(tmp_path / "nvidia.env"))
    assert (result.returncode, result.stderr) == (0, "")
    assert len(result.stdout.splitlines()) == 1
    assert parse_nvml_report(result.stdout) == NvmlReport(
        driver=GB10["DRIVER_VERSION"], gpus=(gb10_reading(),), error=None
    )
    # memory_used_bytes is null because NVML said NOT_SUPPORTED, not because it was left out.
    assert json.loads(result.stdout)["gpus"][0]["memory_used_bytes"] is None


def test_the_report_follows_the_env_file_driver_and_throttle_bits(nvml_lib, tmp_path):
    # 0x4 sw_power_cap, 0x40 hw_thermal_slowdown, 0x200 a bit this report has no name for.
    env = write_env(tmp_path / "nvidia.env", DRIVER_VERSION="580.126.09", CLOCKS_EVENT_REASONS="0x244")
    report = parse_nvml_report(run_report(nvml_lib, env).stdout)
    assert report.driver == "580.126.09"
    assert report.gpus == (gb10_reading(throttle_reasons=("sw_power_cap", "hw_thermal_slowdown", "bit_9")),)


def test_every_named_throttle_bit_reads_back_by_its_name(nvml_lib, tmp_path):
    env = write_env(tmp_path / "nvidia.env", CLOCKS_EVENT_REASONS=str(sum(nvml_report.REASONS)))
    (reading,) = parse_nvml_report(run_report(nvml_lib, env).stdout).gpus
    assert reading.throttle_reasons == tuple(nvml_report.REASONS.values())
    assert set(reading.throttle_reasons) >= {"sw_power_cap", "hw_slowdown", "hw_power_brake", "gpu_idle"}


@pytest.mark.parametrize(
    "setup, error",
    [
        ("no library", "NVML: NVML Shared Library Not Found"),
        ("no env file", "NVML: Driver Not Loaded"),  # nvidia-smi's exit 9
        ("a value missing", "NVML: Unknown Error"),
        ("a malformed value", "NVML: Unknown Error"),
    ],
)
def test_nvml_missing_or_failing_gives_an_error_and_no_traceback(nvml_lib, tmp_path, setup, error):
    library, env = nvml_lib, write_env(tmp_path / "nvidia.env")
    if setup == "no library":
        library = tmp_path / "empty"
    elif setup == "no env file":
        env = tmp_path / "absent.env"
    elif setup == "a value missing":
        env.write_text(env.read_text().replace("SM_CLOCK_MHZ=", "#"))
    else:
        env = write_env(env, GPU_TEMPERATURE_C="44C")
    result = run_report(library, env)
    assert (result.returncode, result.stderr) == (0, "")
    assert parse_nvml_report(result.stdout) == NvmlReport(driver=None, gpus=(), error=error)


def test_without_pynvml_the_report_says_so(nvml_lib, tmp_path):
    result = run_report(nvml_lib, write_env(tmp_path / "nvidia.env"), "-I", "-S")  # -S: no site-packages
    report = parse_nvml_report(result.stdout)
    assert (result.returncode, result.stderr, report.gpus) == (0, "", ())
    assert report.error == "pynvml cannot be imported: No module named 'pynvml'"


def test_without_the_venv_the_command_prints_that_error(tmp_path):
    python = tmp_path / "it's $HOME" / "bin/python"  # quoted, never expanded
    result = subprocess.run(gpu.report_command(str(python)), shell=True, capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr) == (0, "")
    assert parse_nvml_report(result.stdout) == NvmlReport(
        driver=None, gpus=(), error=f"no python at {python} (is the venv built?)"
    )


# --- the stand-in as pynvml itself sees it -------------------------------------------------------


@pytest.fixture
def nvml(nvml_lib, tmp_path, monkeypatch, request):
    """pynvml bound to the stand-in in this process, initialised with the GB10's values (and the
    test's `env` mark's changes)."""
    changes = request.node.get_closest_marker("env")
    env = write_env(tmp_path / "nvidia.env", **(changes.kwargs if changes else {}))
    monkeypatch.setenv("SPARKFORM_NVIDIA_ENV", str(env))
    monkeypatch.setattr(pynvml, "nvmlLib", ctypes.CDLL(str(nvml_lib / "libnvidia-ml.so.1")))
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    pynvml.nvmlInit()
    yield pynvml
    pynvml.nvmlShutdown()


def test_pynvml_sees_one_gb10_with_unified_memory(nvml):
    assert (nvml.nvmlDeviceGetCount(), nvml.nvmlSystemGetCudaDriverVersion()) == (1, 13000)
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_GRAPHICS) == int(GB10["GRAPHICS_CLOCK_MHZ"])
    assert nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle) == 0  # the name before driver 535
    for query in (lambda: nvml.nvmlDeviceGetMemoryInfo(handle), lambda: nvml.nvmlDeviceGetMemoryInfo(handle, 2 << 24)):
        with pytest.raises(nvml.NVMLError_NotSupported, match="Not Supported"):
            query()
    with pytest.raises(nvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM)
    with pytest.raises(nvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetHandleByIndex(1)


def test_after_the_last_shutdown_calls_are_refused(nvml):
    nvml.nvmlInit()  # NVML counts: two inits need two shutdowns
    nvml.nvmlShutdown()
    assert nvml.nvmlDeviceGetCount() == 1
    nvml.nvmlShutdown()
    with pytest.raises(nvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()
    nvml.nvmlInit()  # for the fixture's shutdown


@pytest.mark.env(GPU_NAME="NVIDIA GB10 'it''s' \"quoted\" $HOME \\")
def test_a_name_quoted_by_the_env_writer_reads_back_whole(nvml):
    assert nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(0)) == "NVIDIA GB10 'it''s' \"quoted\" $HOME \\"


# --- the parser -----------------------------------------------------------------------------------

GOOD_GPU = {
    "index": 0,
    "name": "NVIDIA GB10",
    "utilization_percent": 3,
    "sm_clock_mhz": 2400,
    "temperature_c": 44,
    "power_w": 12.0,
    "throttle_reasons": [],
    "memory_used_bytes": None,
}


def report_text(gpus: list[dict] | None = None, **fields: object) -> str:
    return json.dumps({"driver": "580.95.05", "gpus": [GOOD_GPU] if gpus is None else gpus, "error": None, **fields})


def test_a_good_report_parses():
    assert parse_nvml_report(report_text() + "\n") == NvmlReport(driver="580.95.05", gpus=(gb10_reading(),), error=None)


def test_not_supported_readings_are_none():
    nulls = dict.fromkeys(("utilization_percent", "sm_clock_mhz", "temperature_c", "power_w", "memory_used_bytes"))
    (reading,) = parse_nvml_report(report_text([{**GOOD_GPU, **nulls}])).gpus
    assert reading == NvmlGpu(0, "NVIDIA GB10", None, None, None, None, (), None)


def test_a_report_of_a_gpu_with_its_memory_and_throttled():
    values = {"memory_used_bytes": 43712 * 2**20, "power_w": 95, "throttle_reasons": ["sw_power_cap", "bit_9"]}
    (reading,) = parse_nvml_report(report_text([{**GOOD_GPU, **values}])).gpus
    assert (reading.memory_used_bytes, reading.power_w, reading.throttle_reasons) == (
        43712 * 2**20,
        95.0,
        ("sw_power_cap", "bit_9"),
    )


def test_an_error_report_parses():
    text = json.dumps({"driver": None, "gpus": [], "error": "NVML: Driver Not Loaded"})
    assert parse_nvml_report(text) == NvmlReport(driver=None, gpus=(), error="NVML: Driver Not Loaded")


def gpu_text(**changes: object) -> str:
    return report_text([{**GOOD_GPU, **changes}])


@pytest.mark.parametrize(
    "text, named",
    [
        ("", "0 lines"),
        (report_text() + "\n" + report_text(), "2 lines"),
        ("Traceback (most recent call last):", "not JSON"),
        ("[]", "the report: [] is not an object"),
        (json.dumps({"driver": "580.95.05", "gpus": []}), "missing ['error']"),
        (report_text(extra=1), "unexpected ['extra']"),
        (report_text(driver="580.95.05; rm -rf /"), "driver: '580.95.05; rm -rf /' does not match"),
        (report_text(driver=None), "driver: null in a report without an error"),
        (report_text(error="NVML\x1b[2J"), "error: 'NVML\\x1b[2J' is not a line of printable text"),
        (report_text(error=""), "is not a line of printable text"),
        (report_text(error="x" * 501, driver=None, gpus=[]), "501 characters"),
        (report_text(error="NVML: lost"), "gpus: 1 GPUs in a report with an error"),
        (report_text(gpus={"0": GOOD_GPU}), "gpus: {'0': "),
        (report_text(gpus=[GOOD_GPU] * 65), "at most 64 GPUs"),
        (report_text([GOOD_GPU, GOOD_GPU]), "gpus[1].index: 0 where 1 belongs"),
        (gpu_text(index=True), "gpus[0].index: True is not an integer in 0..63"),
        (gpu_text(name="GB10\n; reboot"), "gpus[0].name: 'GB10\\n; reboot' does not match"),
        (gpu_text(name=""), "gpus[0].name: '' does not match"),
        (gpu_text(name=7), "gpus[0].name: 7 does not match"),
        (gpu_text(temperature_c=451), "gpus[0].temperature_c: 451 is not an integer in 0..200"),
        (gpu_text(utilization_percent=-1), "gpus[0].utilization_percent: -1 is not an integer in 0..100"),
        (gpu_text(utilization_percent=3.5), "gpus[0].utilization_percent: 3.5 is not an integer"),
        (gpu_text(sm_clock_mhz="2400"), "gpus[0].sm_clock_mhz: '2400' is not an integer"),
        (gpu_text(memory_used_bytes=2**64), "gpus[0].memory_used_bytes: 18446744073709551616 is not an integer"),
        (gpu_text(power_w="12"), "gpus[0].power_w: '12' is not a number of watts"),
        (gpu_text(power_w=False), "gpus[0].power_w: False is not a number of watts"),
        (gpu_text(power_w=-3.0), "gpus[0].power_w: -3.0 is not a number of watts"),
        (report_text().replace("12.0", "1e999"), "gpus[0].power_w: inf is not a number of watts"),
        (report_text().replace("12.0", "NaN"), "NaN is not a number a report holds"),
        (gpu_text(throttle_reasons="sw_power_cap"), "gpus[0].throttle_reasons: 'sw_power_cap' is not a list"),
        (gpu_text(throttle_reasons=["HW Slowdown"]), "gpus[0].throttle_reasons[0]: 'HW Slowdown' does not match"),
        (gpu_text(throttle_reasons=["gpu_idle", "gpu_idle"]), "names a reason twice"),
        (gpu_text(throttle_reasons=["x"] * 65), "at most 64 names"),
        (gpu_text(fan=1), "gpus[0]: missing nothing, unexpected ['fan']"),
        ("x" * (gpu.MAX_REPORT_CHARS + 1), "more than 65536"),
    ],
)
def test_a_hostile_or_broken_report_is_refused_naming_the_value(text, named):
    with pytest.raises(NvmlReportError) as refused:
        parse_nvml_report(text)
    assert named in str(refused.value)
