"""The GPU's temperature, SM clock and clock-event reasons from nvidia-smi, as metrics for
node_exporter's textfile collector (sampled by sparkform-guard's daemon with monitoring on)."""

import subprocess
import time

from sparkform.host.alerts import journal
from sparkform.host.textfile import metric_family, write_textfile

GPU_REASONS = (
    "gpu_idle",
    "applications_clocks_setting",
    "sw_power_cap",
    "hw_slowdown",
    "sync_boost",
    "sw_thermal_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
)
GPU_QUERY = ("index", "temperature.gpu", "clocks.sm", *(f"clocks_event_reasons.{reason}" for reason in GPU_REASONS))
ACTIVE = {"Active": 1, "Not Active": 0}


def gpu_metrics(csv_text):
    """nvidia-smi's query rows as metrics; a value of another shape ("[N/A]", an error) is left out."""
    temperature, clock, reasons = [], [], []
    for line in csv_text.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != len(GPU_QUERY) or not fields[0].isdigit():
            continue
        gpu = {"gpu": fields[0]}
        if fields[1].isdigit():
            temperature.append((gpu, int(fields[1])))
        if fields[2].isdigit():
            clock.append((gpu, int(fields[2]) * 1e6))
        reasons += [
            ({**gpu, "reason": reason}, ACTIVE[value])
            for reason, value in zip(GPU_REASONS, fields[3:], strict=True)
            if value in ACTIVE
        ]
    return "".join(
        [
            metric_family(
                "sparkform_gpu_temperature_celsius", "gauge", "The GPU's temperature (nvidia-smi).", temperature
            ),
            metric_family("sparkform_gpu_sm_clock_hertz", "gauge", "The GPU's SM clock (nvidia-smi).", clock),
            metric_family(
                "sparkform_gpu_clocks_event_active",
                "gauge",
                "1 while nvidia-smi reports this reason for "
                "lowered clocks (thermal or hardware slowdown, power cap, idle).",
                reasons,
            ),
        ]
    )


def gpu_watch(config):
    """Sample the GPU into its textfile every gpu_poll_s; a failure (no nvidia-smi, no driver) is
    journaled once per kind (the file keeps its last values: node_textfile_mtime_seconds ages)."""
    told = None
    while True:
        try:
            answer = subprocess.run(
                ["nvidia-smi", f"--query-gpu={','.join(GPU_QUERY)}", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            if answer.returncode != 0:
                raise OSError(f"nvidia-smi exited {answer.returncode}: {(answer.stdout + answer.stderr).strip()[:200]}")
            write_textfile(config["gpu_textfile"], gpu_metrics(answer.stdout))
            told = None
        except (OSError, subprocess.SubprocessError) as err:
            if told is not type(err):
                journal(config, f"sparkform-guard: no GPU metrics: {err}", 4)
                told = type(err)
        time.sleep(config["gpu_poll_s"])
