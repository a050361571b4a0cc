"""What `sparkform status` reports: each host's engines and GPU as read in one SSH round trip.

Pure: `status_command` is what runs on the host, `read_status` turns its output into a
`HostStatus` (the documented `--json` object, sparkform/reports/status_schema.py; sparkform/reports/status_table.py
prints it as a table).
Every value read back is checked against the shape it must have; one that is not is left out
(None) and named in `untrusted`, never shown raw.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import time

from sparkform.domain.engine import Engine
from sparkform.domain.layout import FRONT_UNIT, GUARD_UNIT, SCRUB_TIMER, engine_curl
from sparkform.domain.locks import VllmPin
from sparkform.domain.schema import HostConfig
from sparkform.host import ALERT_MESSAGE_ID
from sparkform.readers.gpu import NvmlReportError, parse_nvml_report, report_command
from sparkform.readers.hostrecord import (
    CACHE_KEY_PATTERN,
    ENGINE_NAME_PATTERN,
    LIVE_VERSIONS_COMMAND,
    VERSION_TEXT_PATTERN,
    HostRecord,
    UntrustedValue,
    drift,
    drift_report,
    engine_cache_keys,
    last_cold_starts,
    parse_live_versions,
)
from sparkform.readers.parsers import (
    SYSTEMCTL_SHOW_PROPERTIES,
    Sample,
    engine_states,
    parse_meminfo,
    parse_prometheus,
    parse_systemctl_show,
)
from sparkform.readers.readback import named_lines
from sparkform.readers.remote import plain_file, plain_files, section, split_sections
from sparkform.reports.status_schema import EngineStatus, HostStatus, ServiceStatus, WatchdogEvent
from sparkform.rules.front_tls import fingerprint, read_back, read_command

# What status adds to the deploy's unit properties: the cgroup's memory and when the state changed.
STATUS_PROPERTIES = f"{SYSTEMCTL_SHOW_PROPERTIES},MemoryCurrent,MemoryHigh,MemoryMax,StateChangeTimestamp"
# The vLLM metrics status reads (the rest of /metrics never leaves the host).
VLLM_METRICS = (
    "vllm:cache_config_info",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",  # the name of the KV use before vLLM 0.10
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:generation_tokens_total",
)
# systemd's "Scheduled restart job" entry (SD_MESSAGE_UNIT_RESTART_SCHEDULED): one per automatic
# restart. Counted in the journal because NRestarts starts again from 0 whenever the guard resets
# an engine's start count after it serves (so the start limit is never spent by old failures).
RESTART_SCHEDULED_MESSAGE_ID = "5eb03494b6584870a536b337290809b3"
COUNT_PATTERN = re.compile(r"\d{1,9}")
WATCHDOG_EVENTS_SHOWN = 10
WATCHDOG_EVENT_PATTERN = re.compile(r"[a-z][a-z-]{0,39}")
MESSAGE_PATTERN = re.compile(r"[\x20-\x7e\u00a0-\uffff]{1,500}")  # printable, one line
CLOCK_PATTERN = re.compile(r"\d{9,11}(\.\d{1,9})?")
HTTP_CODE_PATTERN = re.compile(r"\d{3}")
# The units that keep the engines reachable and watched, beside the engines themselves.
SERVICE_UNITS = (GUARD_UNIT, FRONT_UNIT, SCRUB_TIMER)
UNIT_STATE_PATTERN = re.compile(r"[a-z][a-z-]{0,31}")  # systemd's ActiveState and SubState words
# What the engine's launch says while it starts ("waiting q38": its turn behind a loading neighbour).
LAUNCH_STATE_PATTERN = re.compile(r"(waiting|loading)( [a-z0-9][a-z0-9-]{0,39})?")


def _metrics_filter() -> str:
    names = "|".join(re.escape(name) for name in VLLM_METRICS)
    return shlex.quote(f"^({names})[{{ ]")


def _metrics(engine: Engine, config: HostConfig) -> str:
    return f"curl -sS -m 5 {engine_curl(config.engine_socket(engine), '/metrics')} | grep -E {_metrics_filter()}"


def _front_request(engine: Engine, config: HostConfig) -> str:
    """/v1/models through the engine's front port, with the key from stdin as a curl config line."""
    url = config.front_url(engine.port, "/v1/models")
    header = """printf 'header = "Authorization: Bearer %s"\\n' "$sparkform_key" | """ if config.front_keyed else ""
    tls = f"{config.front_curl_tls} " if config.front_tls_on else ""
    return (
        f"{header}curl -s -o /dev/null -m 5 -w '%{{http_code}}\\n' {'-K - ' if header else ''}{tls}{shlex.quote(url)}"
    )


def _installed_vllm(pin: VllmPin) -> str:
    """The version of vLLM installed in `pin`'s venv, as its own python reads it (nothing when there is no venv)."""
    python = shlex.quote(f"{pin.venv}/bin/python")
    code = f"import importlib.metadata as m; print(m.version({pin.package!r}))"
    return f"[ -x {python} ] && {python} -I -c {shlex.quote(code)}"


def _file_kept(path: str) -> str:
    """Says "missing" when `path` is not a plain file (gone, or a link), "kept" when it is."""
    quoted = shlex.quote(path)
    return f"if [ -f {quoted} ] && [ ! -L {quoted} ]; then echo kept; else echo missing; fi"


def _read_version(lines: list[str]) -> str | None:
    text = "".join(lines)
    return text if VERSION_TEXT_PATTERN.fullmatch(text) else None


def status_command(config: HostConfig, sample_s: float) -> str:
    """The one command that reads the host; `sample_s` apart, /metrics is read twice (tokens/s)."""
    units = " ".join(shlex.quote(e.unit) for e in config.engines)
    clock = "date +%s.%N"
    # The API key comes on stdin (never in argv): the first line, read once.
    sections = ["IFS= read -r sparkform_key || true", section("clock", clock)]
    for engine in config.engines:
        sections.append(section(f"metrics:{engine.name}", _metrics(engine, config)))
        sections.append(
            section(
                f"restarts:{engine.name}",
                f"journalctl -b -q --no-pager -o cat -u {shlex.quote(engine.unit)} "
                f"MESSAGE_ID={RESTART_SCHEDULED_MESSAGE_ID} | wc -l",
            )
        )
        sections.append(
            section(
                f"health:{engine.name}",
                "curl -s -o /dev/null -m 5 -w '%{http_code}\\n' "
                + engine_curl(config.engine_socket(engine), "/health"),
            )
        )
        if engine in config.served_engines:
            sections.append(section(f"front:{engine.name}", _front_request(engine, config)))
            state_file = f"{config.paths.lock_dir}/{engine.name}.state"
            sections.append(section(f"launch:{engine.name}", plain_file(state_file)))
    sections.append(f"sleep {sample_s:g}")
    sections.append(section("clock2", clock))
    sections += [section(f"metrics2:{e.name}", _metrics(e, config)) for e in config.engines]
    sections += [
        section("units", f"systemctl show --timestamp=unix -p {STATUS_PROPERTIES} {units}"),
        section("services", f"systemctl show -p Id,ActiveState,SubState {' '.join(SERVICE_UNITS)}"),
        section("meminfo", "grep -E '^(MemTotal|MemAvailable):' /proc/meminfo"),
        section("gpu", report_command(f"{config.venv}/bin/python")),
        *(section(f"vllm:{index}", _installed_vllm(pin)) for index, pin in enumerate(config.pins)),
        section("versions", LIVE_VERSIONS_COMMAND),
        section("record", plain_file(config.paths.host_record)),
        section("cache_keys", plain_files(f"{shlex.quote(config.paths.cache_keys)}/*")),
        section("front_certificate", read_command(config.paths.front_certificate) if config.front_tls_on else "true"),
        section("front_key", _file_kept(config.paths.front_key) if config.front_keyed else "true"),
        section(
            "watchdog", f"journalctl -b -o json --no-pager -n {WATCHDOG_EVENTS_SHOWN} MESSAGE_ID={ALERT_MESSAGE_ID}"
        ),
    ]
    return " ; ".join(sections)


def _bytes(value: str) -> int | None:
    # systemd prints "infinity" or "[not set]" where there is no figure.
    return int(value) if value.isdigit() else None


def _http_code(lines: list[str]) -> int | None:
    code = "".join(lines)
    return int(code) if HTTP_CODE_PATTERN.fullmatch(code) and code != "000" else None


def _first_value(samples: list[Sample], name: str) -> float | None:
    values = [s.value for s in samples if s.name == name and math.isfinite(s.value) and s.value >= 0]
    return values[0] if values else None


def _count(value: float | None) -> int | None:
    return None if value is None else int(value)


def _kv_pool_tokens(samples: list[Sample]) -> int | None:
    for s in samples:
        if s.name == "vllm:cache_config_info":
            labels = s.labels
            if labels.get("kv_cache_size_tokens", "").isdigit():
                return int(labels["kv_cache_size_tokens"])
            if labels.get("num_gpu_blocks", "").isdigit() and labels.get("block_size", "").isdigit():
                return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    return None


def _clock(lines: list[str]) -> float | None:
    return float(lines[0]) if lines and CLOCK_PATTERN.fullmatch(lines[0]) else None


def _tokens_per_s(first: list[Sample], second: list[Sample], seconds: float | None) -> float | None:
    before = _first_value(first, "vllm:generation_tokens_total")
    after = _first_value(second, "vllm:generation_tokens_total")
    if before is None or after is None or not seconds or after < before:  # a counter going down: a restart
        return None
    return round((after - before) / seconds, 1)


def _watchdog_events(lines: list[str], untrusted: list[str]) -> list[WatchdogEvent]:
    events = []
    for line in lines:
        try:
            entry = json.loads(line)
            event = WatchdogEvent(
                at=int(entry["__REALTIME_TIMESTAMP"]) / 1e6,
                event=entry.get("SPARKFORM_EVENT", ""),
                engine=entry.get("SPARKFORM_ENGINE", "-"),
                message=entry["MESSAGE"],
            )
        except (ValueError, KeyError, TypeError):
            continue  # not one of the guard's entries (journald prints binary fields as arrays)
        if (
            WATCHDOG_EVENT_PATTERN.fullmatch(event.event)
            and (event.engine == "-" or ENGINE_NAME_PATTERN.fullmatch(event.engine))
            and MESSAGE_PATTERN.fullmatch(event.message)
        ):
            events.append(event)
        else:
            untrusted.append("a watchdog journal entry in a shape the guard never writes")
    return events


def _record(lines: list[str], untrusted: list[str]) -> HostRecord | None:
    try:
        return HostRecord.from_json("\n".join(lines))
    except UntrustedValue as err:
        untrusted.append(f"the host record: {err}")
        return None


def read_status(host_name: str, config: HostConfig, lines: list[str], checked_at: float | None = None) -> HostStatus:
    """The status in `status_command`'s output."""
    sections, links = split_sections(lines)
    untrusted = [f"{path} is a symbolic link, not followed" for path in links]
    units = engine_states(sections.get("units", []))
    shown = parse_systemctl_show(sections.get("units", []))
    sample_s = None
    start, end = _clock(sections.get("clock", [])), _clock(sections.get("clock2", []))
    if start is not None and end is not None and end > start:
        sample_s = end - start
    record = _record(sections.get("record", []), untrusted)
    cold = last_cold_starts(record, {e.name: e.measured.cold_start_s for e in config.engines})

    pins = config.pins  # the venvs read (a disabled engine's is not built: no version)
    engines = []
    for engine in config.engines:
        state, properties = units.get(engine.unit), shown.get(engine.unit, {})
        first = parse_prometheus(sections.get(f"metrics:{engine.name}", []))
        second = parse_prometheus(sections.get(f"metrics2:{engine.name}", []))
        health_http = _http_code(sections.get(f"health:{engine.name}", []))
        launch = "".join(sections.get(f"launch:{engine.name}", [])).strip()
        active = state is not None and state.active_state == "active"
        since = properties.get("StateChangeTimestamp", "")
        restarts = "".join(sections.get(f"restarts:{engine.name}", [])).strip()
        kv_use = _first_value(first, "vllm:kv_cache_usage_perc")
        if kv_use is None:
            kv_use = _first_value(first, "vllm:gpu_cache_usage_perc")
        engines.append(
            EngineStatus(
                name=engine.name,
                unit=engine.unit,
                enabled=engine.enabled,
                serving=active
                and (health_http == 200 or (config.is_worker(engine) and bool(state and state.main_pid))),
                rank=config.rank(engine),
                active_state=state.active_state if state else "unknown",
                sub_state=state.sub_state if state else "unknown",
                since=float(since[1:]) if since.startswith("@") and since[1:].isdigit() else None,
                restarts=int(restarts) if COUNT_PATTERN.fullmatch(restarts) else state.n_restarts if state else 0,
                main_pid=state.main_pid if state else 0,
                memory_bytes=_bytes(properties.get("MemoryCurrent", "")),
                memory_high_bytes=_bytes(properties.get("MemoryHigh", "")),
                memory_max_bytes=_bytes(properties.get("MemoryMax", "")),
                port=engine.port,
                health_http=health_http,
                front_http=_http_code(sections.get(f"front:{engine.name}", [])),
                launch=launch if LAUNCH_STATE_PATTERN.fullmatch(launch) and not active else None,
                kind=engine.kind,
                vllm_version=(
                    _read_version(sections.get(f"vllm:{pins.index(pin)}", []))
                    if (pin := config.pin(engine)) in pins
                    else None
                ),
                served_names=engine.names,
                kv_pool_tokens=_kv_pool_tokens(first),
                kv_use=kv_use if kv_use is not None and kv_use <= 1 else None,
                requests_running=_count(_first_value(first, "vllm:num_requests_running")),
                requests_waiting=_count(_first_value(first, "vllm:num_requests_waiting")),
                generation_tokens_per_s=_tokens_per_s(first, second, sample_s),
                last_start_at=state.started_at if state else None,
                last_start_s=state.start_s if state else None,
                recorded_cold_start_s=cold.get(engine.name),
            )
        )

    meminfo = parse_meminfo(sections.get("meminfo", []))
    total, available = (
        None if kib is None else kib * 1024 for kib in (meminfo["mem_total_kib"], meminfo["mem_available_kib"])
    )

    report = None
    if sections.get("gpu"):
        try:
            report = parse_nvml_report("\n".join(sections["gpu"]))
        except NvmlReportError as err:
            untrusted.append(f"the GPU report: {err}")
    live = parse_live_versions(sections.get("versions", []), config.pin().label)
    keys = named_lines(
        sections.get("cache_keys", []),
        (ENGINE_NAME_PATTERN, "a cache key file of an engine"),
        (CACHE_KEY_PATTERN, "a cache key"),
        untrusted,
    )
    host_drift = drift(
        record,
        live,
        {e.name: keys.get(e.name) for e in config.engines},
        live_keys=engine_cache_keys(live, {e.name: config.pin(e).label for e in config.engines}),
    )
    services = []
    for unit, state in engine_states(sections.get("services", [])).items():
        if unit not in SERVICE_UNITS:
            continue
        if UNIT_STATE_PATTERN.fullmatch(state.active_state) and UNIT_STATE_PATTERN.fullmatch(state.sub_state):
            services.append(ServiceStatus(unit=unit, active_state=state.active_state, sub_state=state.sub_state))
        else:
            untrusted.append(f"the state of {unit} in a shape systemd never prints")
    problems = _problems(config, engines, services)
    certificate = read_back(sections.get("front_certificate", []), config.paths.front_certificate, untrusted)
    return HostStatus(
        host=host_name,
        reachable=True,
        checked_at=checked_at if checked_at is not None else time.time(),
        serving=not [p for p in problems if not p.startswith(GUARD_UNIT)],
        problems=problems + _unstartable(config, engines) + _front_key_missing(config, sections.get("front_key", [])),
        services=services,
        mem_total_bytes=total,
        mem_available_bytes=available,
        unified_in_use_bytes=total - available if total is not None and available is not None else None,
        gpu=report,
        vllm_version=_read_version(sections.get("vllm:0", [])),
        front_tls=fingerprint(certificate) if certificate else None,
        drift=drift_report(host_drift, cold) if record else [],
        watchdog=_watchdog_events(sections.get("watchdog", []), untrusted),
        engines=engines,
        untrusted=untrusted,
    )


def _problems(config: HostConfig, engines: list[EngineStatus], services: list[ServiceStatus]) -> list[str]:
    served = {e.name for e in config.served_engines}
    problems = [
        f"{e.name} does not serve ({e.active_state}/{e.sub_state})" for e in engines if e.enabled and not e.serving
    ]
    problems += [
        f"{FRONT_UNIT} does not pass a keyed request to {e.name}, which serves (port {e.port}: "
        f"{e.front_http or 'no answer'})"
        for e in engines
        if e.serving and e.name in served and e.front_http != 200
    ]
    states = {s.unit: s for s in services}
    for unit in (GUARD_UNIT, FRONT_UNIT):
        state = states.get(unit)
        if state is None or state.active_state != "active":
            problems.append(f"{unit} is {state.active_state + '/' + state.sub_state if state else 'not read'}")
    return problems


def _unstartable(config: HostConfig, engines: list[EngineStatus]) -> list[str]:
    """Engines whose venv's python did not tell its vLLM's version (gone, or broken): serving or
    not, their next start fails."""
    return [
        f"{e.name}: its venv {config.pin(engine).venv} does not run (no vLLM version from its python), so its "
        "next start fails; the deploy installs it again: pyinfra INVENTORY deploy.py"
        for engine, e in zip(config.engines, engines, strict=True)
        if e.enabled and e.vllm_version is None
    ]


def _front_key_missing(config: HostConfig, lines: list[str]) -> list[str]:
    """The front's key file gone: nginx serves the keys it loaded, but cannot reload or start."""
    if "".join(lines).strip() != "missing":
        return []
    return [
        f"the front's key file {config.paths.front_key} is missing: nginx serves the keys it loaded, but its next "
        "reload or restart fails; the deploy writes it again: pyinfra INVENTORY deploy.py"
    ]


def unreachable(host_name: str, reason: str) -> HostStatus:
    """The status of a host that did not answer."""
    return HostStatus(host=host_name, reachable=False, error=reason, checked_at=time.time(), serving=False)
