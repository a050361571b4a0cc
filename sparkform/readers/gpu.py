"""The GPU as NVML reports it on the host, as `sparkform status` reads it: the report
(sparkform/host/nvml_report.py, which the guard runs too) as the command that runs it with a
venv's python, and its parser, `parse_nvml_report`, which checks every value read back.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkform.host import nvml_report

# The report's source, run as it is with `python -I -c` (the host may hold no copy of it yet).
NVML_REPORT = Path(nvml_report.__file__).read_text(encoding="utf-8")

DRIVER = re.compile(r"[0-9]{1,4}(\.[0-9]{1,4}){1,3}")
GPU_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._()+-]{0,95}")
REASON = re.compile(r"[a-z][a-z0-9_]{0,39}")
MAX_REPORT_CHARS = 64 * 1024
MAX_GPUS = 64
MAX_ERROR_CHARS = 500
# The ranges a reading may have; anything outside is a report to distrust, not a GPU state.
INT_RANGES = {
    "index": (0, MAX_GPUS - 1),
    "utilization_percent": (0, 100),
    "sm_clock_mhz": (0, 10_000),
    "temperature_c": (0, 200),
    "memory_used_bytes": (0, 2**50),
}
MAX_POWER_W = 10_000.0
REPORT_KEYS = ("driver", "gpus", "error")
GPU_KEYS = (
    "index",
    "name",
    "utilization_percent",
    "sm_clock_mhz",
    "temperature_c",
    "power_w",
    "throttle_reasons",
    "memory_used_bytes",
)


class NvmlReportError(ValueError):
    """A report that is not what NVML_REPORT prints; the message names the value."""


@dataclass(frozen=True)
class NvmlGpu:
    """One GPU as NVML read it; None: the GPU does not support that reading."""

    index: int
    name: str
    utilization_percent: int | None
    sm_clock_mhz: int | None
    temperature_c: int | None
    power_w: float | None
    throttle_reasons: tuple[str, ...]
    memory_used_bytes: int | None


@dataclass(frozen=True)
class NvmlReport:
    """The host's GPUs and driver, or why NVML could not say (`error`)."""

    driver: str | None
    gpus: tuple[NvmlGpu, ...]
    error: str | None


def report_command(python: str) -> str:
    """The shell command that prints the report with `python` (a venv's, which has pynvml): -I
    keeps the environment and the working folder out of what it imports. Without that python (a
    host never converged) it prints the report of that error, so the answer is always one line."""
    missing: dict[str, object] = {"driver": None, "gpus": [], "error": f"no python at {python} (is the venv built?)"}
    quoted = shlex.quote(python)
    return (
        f"if [ -x {quoted} ]; then {quoted} -I -c {shlex.quote(NVML_REPORT)}; "
        f"else echo {shlex.quote(json.dumps(missing))}; fi"
    )


def _refuse_constant(name: str) -> None:
    raise NvmlReportError(f"{name} is not a number a report holds")


def _keys(value: object, keys: tuple[str, ...], where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise NvmlReportError(f"{where}: {_shown(value)} is not an object")
    missing, extra = [k for k in keys if k not in value], sorted(set(value) - set(keys))
    if missing or extra:
        raise NvmlReportError(f"{where}: missing {missing or 'nothing'}, unexpected {extra or 'nothing'}")
    return value


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _text(value: object, pattern: re.Pattern[str], where: str) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise NvmlReportError(f"{where}: {_shown(value)} does not match {pattern.pattern}")
    return value


def _int(value: object, where: str, field: str, nullable: bool = True) -> int | None:
    if value is None and nullable:
        return None
    low, high = INT_RANGES[field]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise NvmlReportError(f"{where}: {_shown(value)} is not an integer in {low}..{high}")
    return value


def _power(value: object, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_POWER_W:
        raise NvmlReportError(f"{where}: {_shown(value)} is not a number of watts in 0..{MAX_POWER_W:g}")
    return float(value)


def _reasons(value: object, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > 64:
        raise NvmlReportError(f"{where}: {_shown(value)} is not a list of at most 64 names")
    names = tuple(_text(name, REASON, f"{where}[{n}]") for n, name in enumerate(value))
    if len(set(names)) != len(names):
        raise NvmlReportError(f"{where}: {_shown(value)} names a reason twice")
    return names


def _gpu(value: object, position: int) -> NvmlGpu:
    where = f"gpus[{position}]"
    fields = _keys(value, GPU_KEYS, where)
    index = _int(fields["index"], f"{where}.index", "index", nullable=False)
    if index != position:
        raise NvmlReportError(f"{where}.index: {index} where {position} belongs (GPUs are listed in order)")
    return NvmlGpu(
        index=position,
        name=_text(fields["name"], GPU_NAME, f"{where}.name"),
        **{
            field: _int(fields[field], f"{where}.{field}", field)
            for field in ("utilization_percent", "sm_clock_mhz", "temperature_c", "memory_used_bytes")
        },
        power_w=_power(fields["power_w"], f"{where}.power_w"),
        throttle_reasons=_reasons(fields["throttle_reasons"], f"{where}.throttle_reasons"),
    )


def parse_nvml_report(text: str) -> NvmlReport:
    """Read what NVML_REPORT printed, checking every value (types, ranges, names against their
    patterns); raises NvmlReportError naming the first value that is not what the script prints."""
    if len(text) > MAX_REPORT_CHARS:
        raise NvmlReportError(f"the report is {len(text)} characters, more than {MAX_REPORT_CHARS}")
    lines = text.strip().splitlines()
    if len(lines) != 1:
        raise NvmlReportError(f"the report is {len(lines)} lines, not one JSON line: {_shown(text)}")
    try:
        value = json.loads(lines[0], parse_constant=_refuse_constant)
    except json.JSONDecodeError as err:
        raise NvmlReportError(f"the report is not JSON ({err}): {_shown(lines[0])}") from None
    fields = _keys(value, REPORT_KEYS, "the report")
    error = fields["error"]
    if error is not None and (not isinstance(error, str) or not error.isprintable() or not error):
        raise NvmlReportError(f"error: {_shown(error)} is not a line of printable text")
    if error is not None and len(error) > MAX_ERROR_CHARS:
        raise NvmlReportError(f"error: {len(error)} characters, more than {MAX_ERROR_CHARS}")
    driver = None if fields["driver"] is None else _text(fields["driver"], DRIVER, "driver")
    gpus = fields["gpus"]
    if not isinstance(gpus, list) or len(gpus) > MAX_GPUS:
        raise NvmlReportError(f"gpus: {_shown(gpus)} is not a list of at most {MAX_GPUS} GPUs")
    if error is None and driver is None:
        raise NvmlReportError("driver: null in a report without an error")
    if error is not None and gpus:
        raise NvmlReportError(f"gpus: {len(gpus)} GPUs in a report with an error ({_shown(error)})")
    return NvmlReport(driver=driver, gpus=tuple(_gpu(gpu, n) for n, gpu in enumerate(gpus)), error=error)
