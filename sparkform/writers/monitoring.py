"""What a Prometheus server needs to watch sparkform hosts: `sparkform monitoring INVENTORY --out DIR`.

Three files, from the inventory alone (no connection): Prometheus' scrape jobs (each host's
node_exporter, and each engine's /metrics through the front), the alert rules (one group per
host, with its own thresholds) and a Grafana dashboard of the pair. The host's side (node_exporter,
its systemd collector and sparkform's textfiles) is the deploy's, with `monitoring.enabled`.
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass
from pathlib import Path

from sparkform.domain import layout
from sparkform.domain.model import Host, InventoryError, Problem
from sparkform.domain.schema import HostConfig
from sparkform.writers.render import bracketed, template

SCRAPE_FILE = "prometheus-scrape.yml"
RULES_FILE = "sparkform-alerts.yml"
DASHBOARD_FILE = "grafana-dashboard.json"
NODE_JOB, VLLM_JOB = "sparkform-node", "sparkform-vllm"
# A host name that can stand inside a PromQL label matcher and a YAML string as it is.
HOST_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,252}")


@dataclass(frozen=True)
class Target:
    """One host as the server side sees it."""

    name: str  # the inventory's name: the `host` label
    node: str  # node_exporter's address:port
    engines: list[tuple[str, str]]  # (engine, the front's address:port) of each enabled engine
    tls: bool  # the front speaks HTTPS: scraped trusting its certificate, `sparkform cert` saved as cert_file
    units: str  # a regex of the enabled engines' units
    burst: int
    restarts_before_limit: int  # NRestarts at which one more failed start spends the start limit
    memory_warn_gib: float
    memory_warn_bytes: int


def reach(address: str, host_address: str) -> str:
    """Where the server reaches a listener on `address`: the host's own address for a wildcard."""
    return host_address if ipaddress.ip_address(address).is_unspecified else bracketed(address)


def target(name: str, config: HostConfig, host_address: str) -> Target:
    front = reach(config.listen_address, host_address)
    return Target(
        name=name,
        node=f"{reach(config.monitoring.listen_address, host_address)}:{config.monitoring.port}",
        engines=[(e.name, f"{front}:{e.port}") for e in config.served_engines],
        tls=config.front_tls_on,
        units="|".join(layout.engine_unit(e.name).replace(".", "[.]") for e in config.enabled_engines),
        burst=config.start_limit_burst,
        restarts_before_limit=max(config.start_limit_burst - 1, 1),
        memory_warn_gib=config.memory_warn_gib,
        memory_warn_bytes=int(config.memory_warn_gib * 2**30),
    )


def targets(hosts: list[Host], addresses: dict[str, str | None]) -> list[Target]:
    """The hosts with monitoring on, each reached at `addresses[name]` (its ssh_hostname) or its
    name; InventoryError when none has it on or a name cannot be a label."""
    problems = [
        Problem(
            h.name,
            "host name",
            h.name,
            "cannot be a Prometheus label value here",
            "name the host with A-Z a-z 0-9 . _ : @ -",
        )
        for h in hosts
        if not HOST_LABEL.fullmatch(h.name)
    ]
    watched = [h for h in hosts if h.config.monitoring.enabled]
    if not watched:
        problems += [
            Problem(
                h.name,
                "monitoring.enabled",
                False,
                "no host of the inventory has monitoring on",
                'set "monitoring": {"enabled": True}',
            )
            for h in hosts
        ]
    if problems:
        raise InventoryError(problems)
    return [target(h.name, h.config, addresses.get(h.name) or h.name) for h in watched]


def cert_file(name: str) -> str:
    """The file, beside the scrape config, that holds the certificate of host `name`'s front."""
    return f"{name}-front.pem"


def _prometheus_template(name: str) -> str:
    """`{{ $labels.NAME }}` and friends, Prometheus' own templating, written by a jinja template."""
    return "{{ " + name + " }}"


def scrape_config(found: list[Target], inventory: str) -> str:
    return template(
        "monitoring/prometheus-scrape.yml.j2",
        hosts=found,
        inventory=inventory,
        rules_file=RULES_FILE,
        vllm_job=VLLM_JOB,
        cert_file=cert_file,
    )


# Every alert kind the guard, the scrub, the rollback and a rank raise, by the rule that fires on
# it (tests/unit/test_monitoring.py holds this against sparkform.host.alerts' lists).
ACTED_EVENTS = ("stopped", "stalled", "hung", "failed", "cannot-restart", "memory-low", "memory-critical", "head-lost")
RECOVERY_EVENTS = ("recovered", "memory-recovered", "checkpoint-repaired", "front-recovered", "disk-recovered")


def alert_rules(found: list[Target], inventory: str) -> str:
    return template(
        "monitoring/alerts.yml.j2",
        hosts=found,
        inventory=inventory,
        acted="|".join(ACTED_EVENTS),
        recoveries="|".join(RECOVERY_EVENTS),
        label=lambda name: _prometheus_template(f"$labels.{name}"),
        value=lambda: _prometheus_template("$value"),
        value_percent=lambda: _prometheus_template("$value | humanizePercentage"),
    )


def _panel(
    panel_id: int, title: str, kind: str, grid: tuple[int, int, int, int], *exprs: tuple[str, str], unit: str = "short"
) -> dict:
    x, y, w, h = grid
    return {
        "id": panel_id,
        "type": kind,
        "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend} for i, (expr, legend) in enumerate(exprs)
        ],
    }


def dashboard() -> dict:
    """The pair on one host (the `host` variable): unit states, restarts, KV cache, requests,
    tokens/s, memory and the guard's alerts."""
    node = f'job="{NODE_JOB}",host="$host"'
    vllm = f'job="{VLLM_JOB}",host="$host"'
    units = f'name=~"{layout.UNIT_PREFIX}.+"'

    def gpu(name: str) -> str:
        return f"sparkform_gpu_{name}{{{node}}}"

    def latency(histogram: str) -> list[tuple[str, str]]:
        """The median and the 95th percentile of a vLLM histogram, per engine, over 5 minutes."""
        rate = f"sum by (le, engine) (rate(vllm:{histogram}_bucket{{{vllm}}}[5m]))"
        return [(f"histogram_quantile({q}, {rate})", f"{{{{engine}}}} p{round(q * 100)}") for q in (0.5, 0.95)]

    panels = [
        _panel(
            1,
            "Engine units active",
            "stat",
            (0, 0, 8, 4),
            (f'node_systemd_unit_state{{{node},{units},state="active"}}', "{{name}}"),
        ),
        _panel(
            2,
            "Restarts without serving (NRestarts)",
            "stat",
            (8, 0, 8, 4),
            (f"node_systemd_service_restart_total{{{node},{units}}}", "{{name}}"),
        ),
        _panel(
            3,
            "MemAvailable",
            "stat",
            (16, 0, 8, 4),
            (f"node_memory_MemAvailable_bytes{{{node}}}", "MemAvailable"),
            unit="bytes",
        ),
        _panel(
            4,
            "KV cache use",
            "timeseries",
            (0, 4, 12, 8),
            (f"vllm:kv_cache_usage_perc{{{vllm}}}", "{{engine}}"),
            unit="percentunit",
        ),
        _panel(
            5,
            "Requests running and waiting",
            "timeseries",
            (12, 4, 12, 8),
            (f"vllm:num_requests_running{{{vllm}}}", "{{engine}} running"),
            (f"vllm:num_requests_waiting{{{vllm}}}", "{{engine}} waiting"),
        ),
        _panel(
            6,
            "Generation tokens/s",
            "timeseries",
            (0, 12, 12, 8),
            (f"rate(vllm:generation_tokens_total{{{vllm}}}[1m])", "{{engine}}"),
        ),
        _panel(
            7,
            "Memory",
            "timeseries",
            (12, 12, 12, 8),
            (f"node_memory_MemAvailable_bytes{{{node}}}", "MemAvailable"),
            (f"node_memory_MemTotal_bytes{{{node}}}", "MemTotal"),
            unit="bytes",
        ),
        _panel(
            8,
            "Engine starts",
            "timeseries",
            (0, 20, 12, 8),
            (f"node_systemd_unit_start_time_seconds{{{node},{units}}} * 1000", "{{name}}"),
            unit="dateTimeAsIso",
        ),
        _panel(
            9,
            "Guard alerts (last hour)",
            "timeseries",
            (12, 20, 12, 8),
            (f"increase(sparkform_guard_alerts_total{{{node}}}[1h]) > 0", "{{event}} {{engine}}"),
        ),
        _panel(
            10,
            "Recorded cold starts",
            "stat",
            (0, 28, 12, 4),
            (f"sparkform_engine_cold_start_seconds{{{node}}}", "{{engine}}"),
            unit="s",
        ),
        _panel(
            11,
            "Last converge",
            "stat",
            (12, 28, 12, 4),
            (f"sparkform_converge_timestamp_seconds{{{node}}} * 1000", "record written"),
            unit="dateTimeAsIso",
        ),
        _panel(
            12,
            "Requests per client (the front's access log)",
            "timeseries",
            (0, 32, 24, 8),
            (f"sum by (client, code) (rate(sparkform_front_requests_total{{{node}}}[5m]))", "{{client}} {{code}}"),
            unit="reqps",
        ),
        # The signals vLLM's own Spark guidance names: the GPU's heat and clocks, and latency.
        _panel(
            13,
            "GPU temperature",
            "timeseries",
            (0, 40, 8, 8),
            (gpu("temperature_celsius"), "GPU {{gpu}}"),
            unit="celsius",
        ),
        _panel(14, "GPU SM clock", "timeseries", (8, 40, 8, 8), (gpu("sm_clock_hertz"), "GPU {{gpu}}"), unit="hertz"),
        _panel(
            15,
            "GPU clock-event reasons (throttling)",
            "timeseries",
            (16, 40, 8, 8),
            (f"{gpu('clocks_event_active')} == 1", "GPU {{gpu}} {{reason}}"),
        ),
        _panel(
            16, "Time to first token", "timeseries", (0, 48, 12, 8), *latency("time_to_first_token_seconds"), unit="s"
        ),
        _panel(
            17, "Inter-token latency", "timeseries", (12, 48, 12, 8), *latency("inter_token_latency_seconds"), unit="s"
        ),
    ]
    return {
        "title": "sparkform: the engine pair",
        "uid": "sparkform-pair",
        "tags": ["sparkform", "vllm"],
        "timezone": "browser",
        "schemaVersion": 39,
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "30s",
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
                {
                    "name": "host",
                    "type": "query",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": {"query": f'label_values(up{{job="{NODE_JOB}"}}, host)', "refId": "hosts"},
                    "definition": f'label_values(up{{job="{NODE_JOB}"}}, host)',
                    "refresh": 2,
                },
            ]
        },
        "panels": panels,
    }


def write(hosts: list[Host], addresses: dict[str, str | None], inventory: str, out: Path) -> list[Path]:
    """Write the three files into `out` (made if missing); returns their paths."""
    found = targets(hosts, addresses)
    out.mkdir(parents=True, exist_ok=True)
    files = {
        SCRAPE_FILE: scrape_config(found, inventory),
        RULES_FILE: alert_rules(found, inventory),
        DASHBOARD_FILE: json.dumps(dashboard(), indent=2) + "\n",
    }
    for name, content in files.items():
        (out / name).write_text(content)
    return [out / name for name in files]
