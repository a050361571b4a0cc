"""The table `sparkform status` prints: one block per host, one row per engine; 100 columns at
most by default (the columns a glance needs, long lines wrapped), every column with --wide."""

from __future__ import annotations

import textwrap
import time

from sparkform.readers.gpu import NvmlReport
from sparkform.reports.status_schema import EngineStatus, HostStatus

GIB = 1024**3
COLUMNS = (
    "ENGINE", "VLLM", "STATE", "SINCE", "RESTARTS", "PID", "MEMORY GiB now/high/max", "PORT", "SERVED AS",
    "KV POOL tokens", "KV USE", "RUNNING", "WAITING", "GEN tok/s", "LAST START", "COLD START",
)  # fmt: skip
# The narrow table's columns (of COLUMNS), with shorter headings: what a glance needs.
NARROW = {"ENGINE": "ENGINE", "VLLM": "VLLM", "STATE": "STATE", "SINCE": "SINCE", "RESTARTS": "RESTARTS",
          "KV USE": "KV USE", "RUNNING": "RUN", "WAITING": "WAIT", "GEN tok/s": "TOK/S",
          "LAST START": "LAST START"}  # fmt: skip
WIDTH = 100


def _ago(at: float | None, now: float) -> str:
    if at is None:
        return "-"
    seconds = max(0, int(now - at))
    if seconds < 120:
        return f"{seconds}s ago"
    if seconds < 7200:
        return f"{seconds // 60}m ago"
    if seconds < 172800:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m ago"
    return f"{seconds // 86400}d ago"


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / GIB:.1f}"


def _or_dash(value: object, form: str = "{}") -> str:
    return "-" if value is None else form.format(value)


def _engine_row(e: EngineStatus, now: float, wide: bool) -> list[str]:
    state = (f"{e.active_state}/{e.sub_state}" if wide else e.active_state) + ("" if e.enabled else " (disabled)")
    if e.rank:
        state += f" (rank {e.rank}, headless)"
    elif e.active_state == "active" and not e.serving:
        state += f" /health {e.health_http or 'no answer'}"
    elif e.launch and e.launch.startswith("waiting "):
        state += f" (waits for {e.launch.split()[1]})"
    return [
        e.name if e.kind == "generate" else f"{e.name} ({e.kind})",
        _or_dash(e.vllm_version),
        state,
        _ago(e.since, now),
        str(e.restarts),
        str(e.main_pid or "-"),
        " / ".join(_gib(v) for v in (e.memory_bytes, e.memory_high_bytes, e.memory_max_bytes)),
        str(e.port),
        ",".join(e.served_names),
        _or_dash(e.kv_pool_tokens, "{:,}"),
        _or_dash(None if e.kv_use is None else e.kv_use * 100, "{:.0f}%"),
        _or_dash(e.requests_running),
        _or_dash(e.requests_waiting),
        _or_dash(e.generation_tokens_per_s, "{:.1f}"),
        _or_dash(e.last_start_s, "{:.0f} s") + ("" if e.last_start_at is None else f" ({_ago(e.last_start_at, now)})"),
        _or_dash(e.recorded_cold_start_s, "{:.0f} s"),
    ]


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]


def _gpu_lines(report: NvmlReport | None) -> list[str]:
    if report is None:
        return ["GPU: not read"]
    if report.error:
        return [f"GPU: NVML says {report.error}"]
    return [
        f"GPU {g.index} {g.name}: driver {report.driver or '-'}, util {_or_dash(g.utilization_percent, '{}%')}, "
        f"SM {_or_dash(g.sm_clock_mhz, '{} MHz')}, {_or_dash(g.temperature_c, '{} C')}, "
        f"{_or_dash(g.power_w, '{:.1f} W')}, throttle: {', '.join(g.throttle_reasons) or 'none'}"
        for g in report.gpus
    ]


def _narrow(rows: list[list[str]]) -> list[list[str]]:
    keep = [COLUMNS.index(name) for name in NARROW]
    return [[NARROW[COLUMNS[i]] for i in keep]] + [[row[i] for i in keep] for row in rows[1:]]


def _wrapped(line: str) -> list[str]:
    return textwrap.wrap(line, WIDTH, subsequent_indent="    ", break_on_hyphens=False) or [""]


def format_status(status: HostStatus, wide: bool = False) -> str:
    """The block a person reads for one host: at most WIDTH columns unless `wide` (a host not
    read is one line, whatever ssh said)."""
    if not status.reachable:
        return f"{status.host}: NOT READ: {status.error}"
    lines = _status_lines(status, wide)
    return "\n".join(lines if wide else [part for line in lines for part in _wrapped(line)])


def _status_lines(status: HostStatus, wide: bool) -> list[str]:
    now = status.checked_at
    down = [e.name for e in status.engines if e.enabled and not e.serving]
    head = f"{status.host}: " + (
        f"NOT SERVING: {', '.join(down)}" if down else "NOT SERVING CLIENTS" if not status.serving else "serving"
    )
    memory = (
        f"memory: {_gib(status.mem_available_bytes)} GiB available of {_gib(status.mem_total_bytes)} GiB "
        f"({_gib(status.unified_in_use_bytes)} GiB in use, CPU and GPU together)"
    )
    lines = [f"{head}   {memory}   vLLM {status.vllm_version or '-'}", *_gpu_lines(status.gpu)]
    lines.append("units: " + ", ".join(f"{u.unit} {u.active_state}/{u.sub_state}" for u in status.services))
    if status.front_tls:  # 95 characters: a line of its own
        lines += ["front: HTTPS, its certificate's SHA-256 fingerprint:", f"  {status.front_tls}"]
    rows = [list(COLUMNS), *(_engine_row(e, now, wide) for e in status.engines)]
    lines += _table(rows if wide else _narrow(rows))
    lines += [f"problem: {line}" for line in status.problems]
    lines += [f"drift since the record: {line}" for line in status.drift]
    lines += [
        f"watchdog {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(w.at))} {w.engine} {w.event}: {w.message}"
        for w in status.watchdog
    ]
    lines += [f"left out (untrusted): {line}" for line in status.untrusted]
    return lines
