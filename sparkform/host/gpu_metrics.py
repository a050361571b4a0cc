"""The GPU's temperature, SM clock and clock-event reasons as NVML reports them, as metrics for
node_exporter's textfile collector (sampled by sparkform-guard's daemon with monitoring on). The
reader is sparkform.host.nvml_report, the one `sparkform status` runs too, run by an engine venv's
python (which holds pynvml; the guard's own python3 does not)."""

import json
import subprocess
import time

from sparkform.host import GuardSettings
from sparkform.host.alerts import journal
from sparkform.host.nvml_report import REASONS
from sparkform.host.textfile import metric_family, write_textfile

MAX_REPORT_BYTES = 64 * 1024


def reading(value, low, high):
    """A number of the report within its range, else None (left out of the metrics)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and low <= value <= high else None


def gpu_metrics(report):
    """The report's GPUs as metrics; a value of another shape or range is left out."""
    temperature, clock, reasons = [], [], []
    for gpu in report.get("gpus") or []:
        index = reading(gpu.get("index"), 0, 63) if isinstance(gpu, dict) else None
        if index is None:
            continue
        labels = {"gpu": str(index)}
        if (celsius := reading(gpu.get("temperature_c"), 0, 200)) is not None:
            temperature.append((labels, celsius))
        if (mhz := reading(gpu.get("sm_clock_mhz"), 0, 10_000)) is not None:
            clock.append((labels, mhz * 1e6))
        active = gpu.get("throttle_reasons")
        if isinstance(active, list):
            reasons += [({**labels, "reason": reason}, int(reason in active)) for reason in REASONS.values()]
    return "".join(
        [
            metric_family("sparkform_gpu_temperature_celsius", "gauge", "The GPU's temperature (NVML).", temperature),
            metric_family("sparkform_gpu_sm_clock_hertz", "gauge", "The GPU's SM clock (NVML).", clock),
            metric_family(
                "sparkform_gpu_clocks_event_active",
                "gauge",
                "1 while NVML reports this reason for lowered clocks (thermal or hardware slowdown, power cap, idle).",
                reasons,
            ),
        ]
    )


def gpu_watch(config: GuardSettings):
    """Sample the GPU into its textfile every gpu_poll_s; a failure (no venv yet, no driver, NVML's
    error) is journaled once per kind (the file keeps its last values: node_textfile_mtime_seconds ages)."""
    told = None
    while True:
        try:
            answer = subprocess.run(
                [config["gpu_python"], "-I", config["nvml_report"]], capture_output=True, text=True, timeout=60
            )
            report = json.loads(answer.stdout[:MAX_REPORT_BYTES] or "null")
            if not isinstance(report, dict) or report.get("error"):
                raise OSError(f"NVML: {str(report.get('error') if isinstance(report, dict) else answer.stderr)[:200]}")
            write_textfile(config["gpu_textfile"], gpu_metrics(report))
            told = None
        except (OSError, ValueError, subprocess.SubprocessError) as err:
            if told != str(err):
                journal(config, f"sparkform-guard: no GPU metrics: {err}", 4)
                told = str(err)
        time.sleep(config["gpu_poll_s"])
