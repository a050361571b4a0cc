"""The GPU as NVML reports it, one JSON line on stdout and never a traceback (stdlib + pynvml,
the module of nvidia-ml-py, which every engine venv holds: see locks/). The one GPU reader of
sparkform: `sparkform status` runs this source with the venv's python over SSH, and the guard
runs the installed copy for its textfile metrics (sparkform.host.gpu_metrics).

    {"driver": str|null,
     "gpus": [{"index": int, "name": str, "utilization_percent": int|null,
               "sm_clock_mhz": int|null, "temperature_c": int|null, "power_w": float|null,
               "throttle_reasons": [str, ...], "memory_used_bytes": int|null}, ...],
     "error": str|null}

A reading the GPU does not support is null (GB10's memory: unified memory, NVML answers
NOT_SUPPORTED); NVML missing or failing gives `gpus: []` and the reason in `error`.
`throttle_reasons` names the bits of NVML's clocks event (throttle) reasons, REASONS.
"""

import json

# NVML's nvmlClocksEventReason* bits (nvml.h), by the names the report gives them; any other
# set bit is named `bit_N`.
REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake",
    0x100: "display_clock_setting",
}


def main():
    try:
        import pynvml
    except Exception as error:
        return {"driver": None, "gpus": [], "error": f"pynvml cannot be imported: {error}"}
    driver = None
    try:
        pynvml.nvmlInit()
    except Exception as error:
        return {"driver": None, "gpus": [], "error": f"NVML: {error}"}
    try:
        driver = text(pynvml.nvmlSystemGetDriverVersion())
        gpus = [gpu(pynvml, index) for index in range(pynvml.nvmlDeviceGetCount())]
        return {"driver": driver, "gpus": gpus, "error": None}
    except Exception as error:
        return {"driver": driver, "gpus": [], "error": f"NVML: {type(error).__name__}: {error}"}
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def text(value):
    return value.decode() if isinstance(value, bytes) else value


def reading(pynvml, call, *args):
    # None when this GPU does not support the query (GB10's memory).
    try:
        return call(*args)
    except pynvml.NVMLError_NotSupported:
        return None


def reasons(pynvml, handle):
    try:
        mask = reading(pynvml, pynvml.nvmlDeviceGetCurrentClocksEventReasons, handle)
    except pynvml.NVMLError_FunctionNotFound:  # a driver before 535 knows the older name
        mask = reading(pynvml, pynvml.nvmlDeviceGetCurrentClocksThrottleReasons, handle)
    bits = [1 << n for n in range(64) if (mask or 0) >> n & 1]
    return [REASONS.get(bit, f"bit_{bit.bit_length() - 1}") for bit in bits]


def gpu(pynvml, index):
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    utilization = reading(pynvml, pynvml.nvmlDeviceGetUtilizationRates, handle)
    power_mw = reading(pynvml, pynvml.nvmlDeviceGetPowerUsage, handle)
    memory = reading(pynvml, pynvml.nvmlDeviceGetMemoryInfo, handle)
    return {
        "index": index,
        "name": text(pynvml.nvmlDeviceGetName(handle)),
        "utilization_percent": None if utilization is None else utilization.gpu,
        "sm_clock_mhz": reading(pynvml, pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_SM),
        "temperature_c": reading(pynvml, pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU),
        "power_w": None if power_mw is None else power_mw / 1000,
        "throttle_reasons": reasons(pynvml, handle),
        "memory_used_bytes": None if memory is None else memory.used,
    }


def report():
    """main()'s report, or the report of whatever it raised: always one JSON object."""
    try:
        return main()
    except BaseException as error:
        return {"driver": None, "gpus": [], "error": f"{type(error).__name__}: {error}"}


if __name__ == "__main__":
    print(json.dumps(report()))
