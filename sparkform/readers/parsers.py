"""Parsers for what a DGX Spark prints: vLLM boot logs, /proc/meminfo, nvidia-smi, systemctl show.

Pure functions over lists of lines, no I/O, so the snapshot fact and the verify suite stay thin and every format
can be tested against captured output. They never raise on unexpected input: lines that do
not match are skipped, and a field that cannot be read becomes None.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace
from typing import Any

from sparkform.host import kvlog

KIB_PER_GIB = 1024 * 1024

# vLLM's KV pool lines are read by the patterns the host's KV ledger uses (sparkform.host.kvlog).
_CUDA_VERSION_RE = re.compile(r"CUDA Version:\s*(?P<version>\d+(?:\.\d+)*)")
_COMPUTE_CAP_RE = re.compile(r"^\d+\.\d+$")

# The one list of unit properties sparkform reads (with `systemctl show --timestamp=unix`).
SYSTEMCTL_SHOW_PROPERTIES = (
    "Id,LoadState,ActiveState,SubState,NRestarts,MainPID,ExecMainStatus,Result,UnitFileState,"
    "After,ExecMainStartTimestamp,ExecMainStartTimestampMonotonic,ActiveEnterTimestampMonotonic"
)


class _JsonFactValue:
    """Lets `pyinfra HOST fact ...` print these values: its JSON encoder calls to_json()."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]  # mixed into dataclasses only


def _grouped_int(text: str) -> int:
    return int(text.replace(",", ""))


# --- vLLM KV cache pool ------------------------------------------------------------------------


@dataclass(frozen=True)
class KvPool(_JsonFactValue):
    """The KV cache pool one vLLM boot reported.

    + device: the device word of the log line (GPU, CPU, XPU)
    + tokens: the pool size in tokens
    + max_model_len: the per-request length the concurrency refers to
    + concurrency: how many full-length requests fit in the pool at once
    + available_gib: the memory vLLM gave the KV cache (GPU only; absent when
      ``--kv-cache-memory-bytes`` is set)
    """

    device: str
    tokens: int
    max_model_len: int | None
    concurrency: float | None
    available_gib: float | None

    @property
    def complete(self) -> bool:
        return self.concurrency is not None


def parse_kv_pool(lines: list[str]) -> KvPool | None:
    """Return the KV pool of the latest boot in a vLLM log, or None when none is logged.

    Understands the three formats vLLM has used: two lines (<= 0.27: the size line, then the
    concurrency line), one line (0.28-0.29), and one line with a device word (0.30+:
    ``GPU``/``CPU``/``XPU``, possibly followed by ``+ host``). The "Available KV cache memory"
    line that precedes the pool on GPUs is attached to it.

    When several boots are logged, the last complete pool (size and concurrency) wins; a
    size line without its concurrency line is returned only when no boot completed.
    """
    pools: list[KvPool] = []
    pending_available_gib: float | None = None
    for line in lines:
        if kvlog.KV_VERSION.search(line):  # a new start: what an earlier one printed is stale
            pending_available_gib = None
        available = kvlog.KV_AVAILABLE.search(line)
        if available:
            pending_available_gib = float(available["gib"])
        size = kvlog.KV_SIZE.search(line)
        if size:
            pools.append(
                KvPool(
                    device=size["device"],
                    tokens=_grouped_int(size["tokens"]),
                    max_model_len=None,
                    concurrency=None,
                    available_gib=pending_available_gib,
                )
            )
            pending_available_gib = None
        concurrency = kvlog.KV_CONCURRENCY.search(line)
        # The concurrency belongs to the pool logged just before it (same line from 0.28 on).
        if concurrency and pools and not pools[-1].complete:
            pools[-1] = replace(
                pools[-1],
                max_model_len=_grouped_int(concurrency["max_model_len"]),
                concurrency=float(concurrency["concurrency"].replace(",", "")),
            )
    complete = [pool for pool in pools if pool.complete]
    if complete:
        return complete[-1]
    return pools[-1] if pools else None


def parse_vllm_version(lines: list[str]) -> str | None:
    """The vLLM version the latest API server start in a log printed, or None."""
    versions = [match["version"] for line in lines if (match := kvlog.KV_VERSION.search(line))]
    return versions[-1] if versions else None


# --- /proc/meminfo -------------------------------------------------------------------------------


def parse_meminfo(lines: list[str]) -> dict[str, int | float | None]:
    """Read total and available memory from ``/proc/meminfo``.

    On GB10 NVML cannot report memory (unified memory), so this is the memory figure the
    toolkit plans with. Returns ``mem_total_kib``, ``mem_available_kib`` and the same in GiB
    (``mem_total_gib``, ``mem_available_gib``); a key whose line is missing maps to None.
    """
    kib: dict[str, int] = {}
    for line in lines:
        key, _, rest = line.partition(":")
        fields = rest.split()
        if key in ("MemTotal", "MemAvailable") and fields and fields[0].isdigit():
            kib[key] = int(fields[0])
    total = kib.get("MemTotal")
    available = kib.get("MemAvailable")
    return {
        "mem_total_kib": total,
        "mem_available_kib": available,
        "mem_total_gib": total / KIB_PER_GIB if total is not None else None,
        "mem_available_gib": available / KIB_PER_GIB if available is not None else None,
    }


# --- nvidia-smi ----------------------------------------------------------------------------------

NVIDIA_SMI_QUERY_FIELDS = "name,driver_version,memory.total,memory.used,compute_cap"


@dataclass(frozen=True)
class Gpu(_JsonFactValue):
    """One row of ``nvidia-smi --query-gpu=NVIDIA_SMI_QUERY_FIELDS``.

    + name: the product name, e.g. ``NVIDIA GB10``
    + driver_version: e.g. ``580.95.05``
    + memory_total_mib: None where the device does not report it (GB10)
    + memory_used_mib: None where the device does not report it (GB10)
    + compute_cap: e.g. ``12.1``
    """

    name: str
    driver_version: str
    memory_total_mib: int | None
    memory_used_mib: int | None
    compute_cap: str


@dataclass(frozen=True)
class GpuReport(_JsonFactValue):
    """The GPUs nvidia-smi lists and the CUDA version its banner names (empty without a driver)."""

    gpus: tuple[Gpu, ...] = ()
    cuda_version: str | None = None


def _mib_or_none(text: str) -> int | None:
    # Anything but a number is what nvidia-smi prints for a field the device does not
    # report: `[N/A]`, `N/A`, `Not Supported`, `[Not Supported]` (GB10 memory, for one).
    return int(text) if text.isdigit() else None


def parse_nvidia_smi_csv(lines: list[str]) -> list[Gpu]:
    """Parse ``--format=csv,noheader,nounits`` rows of the query in ``NVIDIA_SMI_QUERY_FIELDS``.

    Memory reads ``[N/A]`` or ``Not Supported`` on GB10 and becomes None. Lines that are not
    such rows (the banner, a "failed to communicate with the driver" message) are skipped.
    """
    gpus = []
    for line in lines:
        # Split from the right so a comma in a product name cannot shift the other fields.
        fields = [field.strip() for field in line.rsplit(",", 4)]
        if len(fields) != 5 or not _COMPUTE_CAP_RE.match(fields[4]):
            continue
        name, driver_version, memory_total, memory_used, compute_cap = fields
        gpus.append(
            Gpu(
                name=name,
                driver_version=driver_version,
                memory_total_mib=_mib_or_none(memory_total),
                memory_used_mib=_mib_or_none(memory_used),
                compute_cap=compute_cap,
            )
        )
    return gpus


def cuda_version_from_nvidia_smi(lines: list[str]) -> str | None:
    """Return the CUDA version from the ``nvidia-smi`` banner (``... CUDA Version: 13.0 |``)."""
    for line in lines:
        match = _CUDA_VERSION_RE.search(line)
        if match:
            return match["version"]
    return None


def parse_gpu_report(lines: list[str]) -> GpuReport:
    """Parse query rows and the banner line printed together (`nvidia-smi --query-gpu`, then
    `nvidia-smi`)."""
    return GpuReport(gpus=tuple(parse_nvidia_smi_csv(lines)), cuda_version=cuda_version_from_nvidia_smi(lines))


# --- systemctl show ------------------------------------------------------------------------------


def parse_systemctl_show(lines: list[str]) -> dict[str, dict[str, str]]:
    """Parse ``systemctl show -p ... unitA unitB`` into ``{unit id: {property: value}}``.

    Units are blocks of ``KEY=VALUE`` lines separated by blank lines. systemctl prints the
    properties in its own order, not the requested one, so ``Id`` may come last in a block;
    blocks without an ``Id`` are dropped. A unit that does not exist still gets a block, with
    ``LoadState=not-found``.
    """
    units: dict[str, dict[str, str]] = {}
    block: dict[str, str] = {}
    for line in [*lines, ""]:
        if not line.strip():
            if "Id" in block:
                units[block["Id"]] = block
            block = {}
            continue
        key, separator, value = line.strip().partition("=")
        if separator:
            block[key] = value
    return units


@dataclass(frozen=True)
class EngineState(_JsonFactValue):
    """The systemd state of one engine unit.

    + unit: the unit id, e.g. ``vllm-nemotron.service``
    + active_state: ``active``, ``activating``, ``failed``, ``inactive``, ...
    + sub_state: ``running``, ``start``, ``dead``, ``auto-restart``, ...
    + n_restarts: how often systemd restarted it (``Restart=``) since it was last started by hand
    + main_pid: 0 when no process runs
    + exec_main_status: the exit status of the last main process
    + result: ``success``, ``exit-code``, ``signal``, ``start-limit-hit``, ...
    + unit_file_state: ``enabled``, ``disabled``, ... (empty for a unit that does not exist)
    + load_state: ``loaded``, or ``not-found`` for a unit that does not exist
    + after: the units its After= orders it behind
    + started_at: unix time its main process last started (None: never)
    + start_s: seconds from that start to active (readiness), None while not active since
    """

    unit: str
    active_state: str
    sub_state: str
    n_restarts: int
    main_pid: int
    exec_main_status: int
    result: str
    unit_file_state: str
    load_state: str = "loaded"
    after: tuple[str, ...] = ()
    started_at: float | None = None
    start_s: float | None = None

    @property
    def exists(self) -> bool:
        return self.load_state != "not-found"


def _int_property(properties: dict[str, str], key: str) -> int:
    # Absent or unset numeric properties (e.g. "[not set]") read as 0, what systemd means by them.
    value = properties.get(key, "")
    return int(value) if value.lstrip("-").isdigit() else 0


def _unix_time(value: str) -> float | None:
    # `systemctl show --timestamp=unix` prints "@1764412345"; empty when it never happened.
    return float(value[1:]) if value.startswith("@") and value[1:].isdigit() else None


def _start_seconds(properties: dict[str, str]) -> float | None:
    started = _int_property(properties, "ExecMainStartTimestampMonotonic")
    active = _int_property(properties, "ActiveEnterTimestampMonotonic")
    return round((active - started) / 1e6, 1) if active > started > 0 else None


def engine_states(lines: list[str]) -> dict[str, EngineState]:
    """Parse ``systemctl show -p SYSTEMCTL_SHOW_PROPERTIES ...`` into an EngineState per unit.

    Units that do not exist are kept (``exists`` is False) so a caller can tell "not
    installed" from "stopped".
    """
    return {
        unit: EngineState(
            unit=unit,
            active_state=properties.get("ActiveState", ""),
            sub_state=properties.get("SubState", ""),
            n_restarts=_int_property(properties, "NRestarts"),
            main_pid=_int_property(properties, "MainPID"),
            exec_main_status=_int_property(properties, "ExecMainStatus"),
            result=properties.get("Result", ""),
            unit_file_state=properties.get("UnitFileState", ""),
            load_state=properties.get("LoadState", "loaded"),
            after=tuple(properties.get("After", "").split()),
            started_at=_unix_time(properties.get("ExecMainStartTimestamp", "")),
            start_s=_start_seconds(properties),
        )
        for unit, properties in parse_systemctl_show(lines).items()
    }


# --- Prometheus text exposition (vLLM's /metrics) -----------------------------------------------

# `name{label="value",...} value [timestamp]`; label values may hold \\, \" and \n escapes.
_SAMPLE_RE = re.compile(
    r"(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>(?:[^\"}]|\"(?:[^\"\\]|\\.)*\")*)\})?"
    r"\s+(?P<value>\S+)(?:\s+-?\d+)?"
)
_LABEL_RE = re.compile(r'\s*(?P<key>[a-zA-Z_][a-zA-Z0-9_]*)="(?P<value>(?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


@dataclass(frozen=True)
class Sample:
    """One sample of a Prometheus text exposition: metric name, labels, value."""

    name: str
    labels: dict[str, str]
    value: float


def _labels(text: str) -> dict[str, str] | None:
    labels, position = {}, 0
    while position < len(text):
        match = _LABEL_RE.match(text, position)
        if not match:
            return None
        labels[match["key"]] = re.sub(r"\\.", lambda m: _UNESCAPE.get(m[0], m[0]), match["value"])
        position = match.end()
    return labels


def parse_prometheus(lines: list[str]) -> list[Sample]:
    """The samples of a Prometheus text exposition; comments and lines that are not a sample
    (or whose value is not a number) are skipped. NaN and infinities are kept as floats."""
    samples = []
    for line in lines:
        match = _SAMPLE_RE.fullmatch(line.strip())
        if not match:
            continue
        labels = _labels(match["labels"] or "")
        try:
            value = float(match["value"])
        except ValueError:
            continue
        if labels is not None:
            samples.append(Sample(match["name"], labels, value))
    return samples
