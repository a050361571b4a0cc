"""Monitoring: the server's files `sparkform monitoring` writes, checked by Prometheus' own promtool
(`check config`, `check rules`, and `test rules` against tests/fixtures/monitoring/alerts-test.yml,
where each alert fires and stays quiet); the textfiles sparkform writes on a host (the record
script's and the guard's, run for real as processes) in a format `promtool check metrics` accepts,
written only into a folder that is the writer's alone; node_exporter's settings."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from script_box import put
from test_guard import ENGINES, Guard, GuardedEngine, engine_socket
from test_rebuild_parts import KEY, SHOW_ACTIVE, VERSIONS

from sparkform.cli import main
from sparkform.domain import layout
from sparkform.domain.schema import Monitoring
from sparkform.host.alerts import ENGINE_EVENTS, HOST_EVENTS
from sparkform.readers.hostrecord import EngineRecord, HostRecord
from sparkform.readers.snapshot import Snapshot
from sparkform.rules.inventory import load_host, load_inventory
from sparkform.sandbox import stage
from sparkform.writers import converge, monitoring
from sparkform.writers.programs import code_files
from sparkform.writers.render import render_host

ROOT = Path(__file__).resolve().parents[2]
MONITORED = ROOT / "tests" / "fixtures" / "inventories" / "monitored.py"
VALID_PAIR = ROOT / "tests" / "fixtures" / "inventories" / "valid_pair.py"
RULES_TEST = ROOT / "tests" / "fixtures" / "monitoring" / "alerts-test.yml"
ALERTS = (
    "SparkformNodeExporterDown",
    "SparkformEngineDown",
    "SparkformEngineRestarting",
    "SparkformStartLimitNearlySpent",
    "SparkformKvCacheHigh",
    "SparkformRequestsWaiting",
    "SparkformMemAvailableLow",
    "SparkformGpuThrottled",
    "SparkformCheckpointCorrupt",
    "SparkformScrubFailed",
    "SparkformGuardActed",
    "SparkformFrontDown",
    "SparkformGuardDiskFull",
    "SparkformDrift",
    "SparkformRolledBack",
    "SparkformRebooted",
    "SparkformCheckpointRepairFailed",
    "SparkformRecovered",
)
NVML_REPORT = str(ROOT / "sparkform" / "host" / "nvml_report.py")


def promtool(*args: str, cwd: Path | None = None, stdin: str | None = None) -> subprocess.CompletedProcess:
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed (make system-deps installs Debian's prometheus)")
    return subprocess.run(["promtool", *args], cwd=cwd, input=stdin, capture_output=True, text=True, timeout=120)


@pytest.fixture
def rendered(tmp_path) -> Path:
    """The server's files for the monitored fixture inventory, as the command writes them."""
    out = tmp_path / "server"
    assert main(["monitoring", str(MONITORED), "--out", str(out)]) == 0
    return out


# --- the server's files ---------------------------------------------------------------------------


def test_the_scrape_config_and_its_rules_pass_promtool(rendered):
    checked = promtool("check", "config", monitoring.SCRAPE_FILE, cwd=rendered)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "1 rule files found" in checked.stdout
    checked = promtool("check", "rules", monitoring.RULES_FILE, cwd=rendered)
    assert checked.returncode == 0 and f"{len(ALERTS)} rules found" in checked.stdout, checked.stdout + checked.stderr


def test_promtool_check_rules_can_fail(rendered):
    rules = rendered / monitoring.RULES_FILE
    rules.write_text(rules.read_text().replace("> 0.9", "> > 0.9", 1))
    assert promtool("check", "rules", str(rules)).returncode != 0


def test_every_alert_fires_and_stays_quiet_under_promtool_test_rules(rendered):
    """tests/fixtures/monitoring/alerts-test.yml: for each alert a series that fires it and one that
    does not (a disabled engine's unit, a value under the threshold, too short a time)."""
    tests = RULES_TEST.read_text()
    assert all(f"alertname: {alert}" in tests for alert in ALERTS)
    shutil.copy(RULES_TEST, rendered / RULES_TEST.name)
    result = promtool("test", "rules", RULES_TEST.name, cwd=rendered)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_kind_the_host_raises_fires_a_rule(rendered):
    """Each event the guard, the scrub, the rollback and a rank alert (sparkform.host.alerts'
    lists, and a rank's head-lost) is matched by a rule's event matcher."""
    rules = (rendered / monitoring.RULES_FILE).read_text()
    matchers = re.findall(r'event=~?"([^"]+)"', rules)
    kinds = {*ENGINE_EVENTS, *HOST_EVENTS, "head-lost"}
    unmatched = {kind for kind in kinds if not any(re.fullmatch(m, kind) for m in matchers)}
    assert unmatched == set(), unmatched


def test_promtool_test_rules_fails_on_a_changed_threshold(rendered):
    rules = rendered / monitoring.RULES_FILE
    rules.write_text(rules.read_text().replace(str(8 * 2**30), str(4 * 2**30)))  # memory_warn_gib 8 -> 4
    shutil.copy(RULES_TEST, rendered / RULES_TEST.name)
    result = promtool("test", "rules", RULES_TEST.name, cwd=rendered)
    assert result.returncode != 0 and "SparkformMemAvailableLow" in result.stdout + result.stderr


def test_targets_reach_wildcard_listeners_at_the_hosts_address(rendered):
    scrape = (rendered / monitoring.SCRAPE_FILE).read_text()
    assert '- targets: ["spark-test.lan:9100"]' in scrape
    assert '- targets: ["spark-test.lan:8012"]' in scrape and 'engine: "fast"' in scrape
    config = load_inventory(MONITORED)[0].config
    loopback = config.model_copy(
        update={
            "listen_address": "::1",
            "monitoring": config.monitoring.model_copy(update={"listen_address": "10.0.0.7"}),
        }
    )
    found = monitoring.target("spark-test", loopback, "spark-test.lan")
    assert found.node == "10.0.0.7:9100" and found.engines[0] == ("fast", "[::1]:8012")


def test_the_dashboard_asks_for_metrics_the_exporters_serve(rendered):
    """Every query names vLLM's metrics as its 0.32 build serves them (vllm:kv_cache_usage_perc,
    not the older gpu_cache_usage_perc), node_exporter's, or sparkform's own."""
    board = json.loads((rendered / monitoring.DASHBOARD_FILE).read_text())
    names = {
        name
        for panel in board["panels"]
        for target in panel["targets"]
        for name in re.findall(r"[A-Za-z_:]+(?=\{)", target["expr"])
    }
    assert names == {
        "node_systemd_unit_state",
        "node_systemd_service_restart_total",
        "node_systemd_unit_start_time_seconds",
        "node_memory_MemAvailable_bytes",
        "node_memory_MemTotal_bytes",
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:generation_tokens_total",
        "sparkform_guard_alerts_total",
        "sparkform_engine_cold_start_seconds",
        "sparkform_converge_timestamp_seconds",
        "sparkform_front_requests_total",
        "sparkform_gpu_temperature_celsius",
        "sparkform_gpu_sm_clock_hertz",
        "sparkform_gpu_clocks_event_active",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
    }
    assert len({panel["id"] for panel in board["panels"]}) == len(board["panels"])


def test_an_inventory_without_monitoring_exits_2_naming_the_field(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["monitoring", str(VALID_PAIR), "--out", str(tmp_path / "server")])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "spark-test: monitoring.enabled = False" in err and '"monitoring": {"enabled": True}' in err
    assert not (tmp_path / "server").exists()


# --- node_exporter's settings on the host ------------------------------------------------------------


def node_exporter_args(config) -> list[str]:
    files = {f.path: f.content for f in render_host(config)}
    line = next(x for x in files[layout.NODE_EXPORTER_DEFAULTS].splitlines() if x.startswith("ARGS="))
    # systemd's EnvironmentFile= unquotes the value, then ExecStart='s $ARGS splits it on spaces.
    return shlex.split(line)[0].removeprefix("ARGS=").split()


def test_node_exporter_reports_sparkforms_units_only():
    config = load_inventory(MONITORED)[0].config
    args = dict(arg.removeprefix("--").partition("=")[::2] for arg in node_exporter_args(config))
    assert args["web.listen-address"] == "0.0.0.0:9100"
    assert args["collector.textfile.directory"] == "/var/lib/prometheus/node-exporter"
    assert "collector.systemd" in args and "collector.systemd.enable-restarts-metrics" in args
    include = re.compile(args["collector.systemd.unit-include"])  # node_exporter anchors it: ^(?:...)$
    exclude = re.compile(args["collector.systemd.unit-exclude"])
    reported = [
        unit
        for unit in (
            "vllm-fast.service",
            "vllm-slow.service",
            "sparkform-engines.target",
            "sparkform-guard.service",
            "sparkform-recover@fast.service",
            "sparkform-retry-fast.timer",
            "nginx.service",
            "ssh.service",
            "vllm-fast.service.d",
            "prometheus-node-exporter.service",
            "multi-user.target",
        )  # fmt: skip
        if include.fullmatch(unit) and not exclude.fullmatch(unit)
    ]
    assert reported == [
        "vllm-fast.service",
        "vllm-slow.service",
        "sparkform-engines.target",
        "sparkform-guard.service",
        "sparkform-recover@fast.service",
        "sparkform-retry-fast.timer",
    ]
    files = {f.path: f.content for f in render_host(config)}
    assert "IPAddressDeny=any\nIPAddressAllow=localhost 192.168.1.5/32\n" in files[layout.NODE_EXPORTER_DROP_IN]


def test_monitoring_off_renders_nothing_of_node_exporter():
    config = load_inventory(VALID_PAIR)[0].config
    paths = {f.path for f in render_host(config)}
    assert not paths & {layout.NODE_EXPORTER_DEFAULTS, layout.NODE_EXPORTER_DROP_IN}


# --- the textfiles, written on the host ----------------------------------------------------------------


def record_script(tmp_path: Path, textfile: Path, *args: str) -> subprocess.CompletedProcess:
    # The launcher at the record's path and the package it runs beside it, as the deploy puts them.
    config = load_inventory(MONITORED)[0].config.model_copy(update={"lib_dir": str(tmp_path / "lib")})
    put(code_files(config), tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "systemctl").write_text(f"#!/bin/sh\nprintf '%s' '{SHOW_ACTIVE}'\n")
    (bin_dir / "systemctl").chmod(0o755)
    planned = HostRecord(VERSIONS, {"fast": EngineRecord(KEY, 200.0, 30.0, 1.0, False), "slow": EngineRecord(KEY)})
    return subprocess.run(
        [sys.executable, config.paths.record, "--textfile", str(textfile), str(tmp_path / "record.json")]
        + [planned.to_json(), *args],
        capture_output=True,
        text=True,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin"},
    )


def test_the_record_script_writes_the_records_metrics(tmp_path):
    folder = tmp_path / "textfiles"
    folder.mkdir(mode=0o755)
    result = record_script(tmp_path, folder / layout.RECORD_TEXTFILE, "slow=vllm-slow.service:cold")
    assert result.returncode == 0, result.stderr
    text = (folder / layout.RECORD_TEXTFILE).read_text()
    checked = promtool("check", "metrics", stdin=text)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert (
        'sparkform_host_info{cuda="13.0",driver="580.95.05",firmware="",gpu_arch="12.1",kernel="6.11",'
        'vllm="vllm-0.27.1"} 1.0' in text
    )
    assert f'sparkform_engine_cache_key_info{{cache_key="{KEY}",engine="slow"}} 1.0' in text
    assert 'sparkform_engine_cold_start_seconds{engine="fast"} 200.0' in text  # recorded before
    assert 'sparkform_engine_cold_start_seconds{engine="slow"} 41.2' in text  # measured by this run
    assert 'sparkform_engine_started_timestamp_seconds{engine="slow"} 1764400000.0' in text
    assert re.search(r"^sparkform_converge_timestamp_seconds \d{10}\.\d+$", text, re.M)
    assert oct((folder / layout.RECORD_TEXTFILE).stat().st_mode & 0o777) == "0o644"
    assert sorted(p.name for p in folder.iterdir()) == [layout.RECORD_TEXTFILE]  # no temp file left


def test_promtool_check_metrics_can_fail():
    assert promtool("check", "metrics", stdin="# TYPE x gauge\nx{a=b} 1\n").returncode != 0


@pytest.mark.parametrize("unsafe", ["group-writable", "a link"])
def test_no_textfile_goes_into_a_folder_another_user_could_swap(tmp_path, unsafe):
    real = tmp_path / "real"
    real.mkdir(mode=0o755)
    folder = tmp_path / "textfiles"
    if unsafe == "a link":
        folder.symlink_to(real)
    else:
        folder.mkdir()
        folder.chmod(0o775)
    result = record_script(tmp_path, folder / layout.RECORD_TEXTFILE)
    assert result.returncode == 4, result.stderr
    assert (tmp_path / "record.json").exists()  # the record itself is written
    assert list(real.iterdir()) == [] and not (folder / layout.RECORD_TEXTFILE).exists()


def test_the_guard_counts_its_alerts_in_its_textfile(tmp_path, socket_dir):
    stubs = [GuardedEngine(engine_socket(socket_dir, name)) for name, _ in ENGINES]
    folder = tmp_path / "textfiles"
    folder.mkdir(mode=0o755)
    guard = Guard(tmp_path, socket_dir, stubs, monitoring={"enabled": True, "textfile_dir": str(folder)})
    try:
        guard.watch()  # writes the file with every count at zero before any alert
        textfile = folder / layout.GUARD_TEXTFILE
        guard.wait(textfile.exists, 10, "the guard's textfile")
        assert 'sparkform_guard_alerts_total{engine="hands",event="hung"} 0.0' in textfile.read_text()
        for _ in range(2):
            assert guard.run("alert", "hung", "hands", "hands hung").returncode == 0
        assert guard.run("alert", "drift", "-", "driver 580 -> 590").returncode == 0
        text = textfile.read_text()
        checked = promtool("check", "metrics", stdin=text)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert 'sparkform_guard_alerts_total{engine="hands",event="hung"} 2.0' in text
        assert 'sparkform_guard_alerts_total{engine="eyes",event="hung"} 0.0' in text
        assert 'sparkform_guard_alerts_total{engine="-",event="drift"} 1.0' in text
        assert re.search(
            r'^sparkform_guard_last_alert_timestamp_seconds\{engine="hands",event="hung"\} \d+', text, re.M
        )
        assert oct(textfile.stat().st_mode & 0o777) == "0o644"
    finally:
        guard.close()
        for stub in stubs:
            stub.close()


def test_the_guard_samples_the_gpu_into_its_textfile(tmp_path, nvml_lib, socket_dir):
    """The daemon runs NVML's report, as `sparkform status` does, by a python with pynvml against
    the sandbox's NVML stand-in (answering as a GB10 slowed down by heat); nvidia-smi is not asked."""
    stubs = [GuardedEngine(engine_socket(socket_dir, name)) for name, _ in ENGINES]
    folder = tmp_path / "textfiles"
    folder.mkdir(mode=0o755)
    guard = Guard(tmp_path, socket_dir, stubs, monitoring={"enabled": True, "textfile_dir": str(folder)})
    settings = json.loads(guard.config_path.read_text())
    guard.config_path.write_text(json.dumps({**settings, "gpu_python": sys.executable, "nvml_report": NVML_REPORT}))
    guard.env["LD_LIBRARY_PATH"] = str(nvml_lib)
    env_file = tmp_path / "nvidia.env"
    # 0x44: NVML's hw_thermal_slowdown (0x40) and sw_power_cap (0x4) bits.
    env_file.write_text(
        stage.nvidia_env_text({**stage.DEFAULT_NVIDIA_ENV, "GPU_TEMPERATURE_C": "91", "CLOCKS_EVENT_REASONS": "0x44"})
    )
    guard.env["SPARKFORM_NVIDIA_ENV"] = str(env_file)
    try:
        guard.watch()
        textfile = folder / layout.GPU_TEXTFILE
        guard.wait(textfile.exists, 10, "the GPU's textfile")
        text = textfile.read_text()
        checked = promtool("check", "metrics", stdin=text)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert 'sparkform_gpu_temperature_celsius{gpu="0"} 91.0' in text
        assert 'sparkform_gpu_sm_clock_hertz{gpu="0"} 2400000000.0' in text
        assert 'sparkform_gpu_clocks_event_active{gpu="0",reason="hw_thermal_slowdown"} 1.0' in text
        assert 'sparkform_gpu_clocks_event_active{gpu="0",reason="sw_power_cap"} 1.0' in text
        assert 'sparkform_gpu_clocks_event_active{gpu="0",reason="hw_slowdown"} 0.0' in text
    finally:
        guard.close()
        for stub in stubs:
            stub.close()


def access_line(client: str, status: int, path: str = "/v1/chat/completions") -> str:
    """A line as the front's log_format (sparkform_clients) writes it."""
    return f'2026-12-04T10:00:00+00:00 192.168.1.5 {client} "POST {path}" {status} 512 0.031\n'


def test_guard_counts_the_fronts_requests_per_client_from_its_access_log(tmp_path, socket_dir):
    """Counted from the log's end at the guard's start, by client and status class; a line of
    another shape is not counted, a rotated log is read from its start."""
    folder = tmp_path / "textfiles"
    folder.mkdir(mode=0o755)
    log = tmp_path / "sparkform-access.log"
    log.write_text(access_line("planner", 200) * 5)  # before the guard started: not counted
    stubs = [GuardedEngine(engine_socket(socket_dir, name)) for name, _ in ENGINES]
    guard = Guard(tmp_path, socket_dir, stubs, monitoring={"enabled": True, "textfile_dir": str(folder)})
    settings = json.loads(guard.config_path.read_text())
    guard.config_path.write_text(json.dumps({**settings, "front_access_log": str(log), "front_count_s": 0.2}))
    textfile = folder / layout.FRONT_TEXTFILE

    def counts() -> dict[tuple[str, str], float]:
        found = re.findall(
            r'sparkform_front_requests_total\{client="([^"]+)",code="(\dxx)"\} (\S+)', textfile.read_text()
        )
        return {(client, code): float(value) for client, code, value in found}

    try:
        guard.watch()
        guard.wait(textfile.exists, 10, "the front's textfile")
        with log.open("a") as out:
            out.write(access_line("planner", 200) * 3 + access_line("coder", 200) + access_line("-", 401))
            out.write('2026-12-04T10:00:01+00:00 1.2.3.4 evil"} 9 "GET /" 200 1 0.1\n')  # not nginx's shape
            out.write(access_line("coder", 429)[:30])  # half a line: counted once it is whole
        want = {("planner", "2xx"): 3.0, ("coder", "2xx"): 1.0, ("-", "4xx"): 1.0}
        guard.wait(lambda: counts() == want, 10, f"the counts {want}")
        with log.open("a") as out:
            out.write(access_line("coder", 429)[30:])
        guard.wait(lambda: counts().get(("coder", "4xx")) == 1.0, 10, "the half line, whole")
        log.rename(tmp_path / "sparkform-access.log.1")  # logrotate
        log.write_text(access_line("coder", 200) * 2)
        guard.wait(lambda: counts().get(("coder", "2xx")) == 3.0, 10, "the rotated log's lines")
        checked = promtool("check", "metrics", stdin=textfile.read_text())
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert "evil" not in textfile.read_text() and counts()[("planner", "2xx")] == 3.0
    finally:
        guard.close()
        for stub in stubs:
            stub.close()


def test_the_guard_keeps_alerting_when_its_textfile_cannot_be_written(tmp_path, socket_dir):
    stubs = [GuardedEngine(engine_socket(socket_dir, name)) for name, _ in ENGINES]
    folder = tmp_path / "textfiles"
    folder.mkdir(mode=0o777)
    os.chmod(folder, 0o777)
    guard = Guard(tmp_path, socket_dir, stubs, monitoring={"enabled": True, "textfile_dir": str(folder)})
    try:
        assert guard.run("alert", "hung", "hands", "hands hung").returncode == 0
        assert [a["event"] for a in guard.webhook_alerts()] == ["hung"]
        assert any("alert metrics were not written" in e.get("MESSAGE", "") for e in guard.journal.read())
        assert list(folder.iterdir()) == []
    finally:
        guard.close()
        for stub in stubs:
            stub.close()


def test_monitoring_settings_are_validated():
    from sparkform.domain.model import InventoryError

    base = {"engines": [{"name": "a", "port": 8012, "checkpoint": {"repo": "o/a", "revision": "main"}}]}
    for monitoring_data, field in (
        ({"listen_address": "prometheus.lan"}, "monitoring.listen_address"),
        ({"port": 0}, "monitoring.port"),
        ({"textfile_dir": "/etc"}, "monitoring.textfile_dir"),
        ({"enable": True}, "monitoring.enable"),
    ):
        with pytest.raises(InventoryError) as err:
            load_host("box", {**base, "monitoring": monitoring_data})
        assert field in str(err.value), err.value


def test_converge_reads_and_manages_node_exporter_only_with_monitoring_on():
    watched = load_inventory(MONITORED)[0].config
    plain = watched.model_copy(update={"monitoring": Monitoring()})
    request = converge.snapshot_request(watched)
    assert layout.NODE_EXPORTER_PACKAGE in request["packages"] and layout.NODE_EXPORTER_UNIT in request["units"]
    assert watched.monitoring.record_textfile in request["paths"]
    assert converge.Folder(watched.monitoring.textfile_dir, "755") in converge.folders(watched)
    assert not set(watched.monitoring.textfiles) & set(converge.unwanted(watched))
    off = converge.snapshot_request(plain)
    assert layout.NODE_EXPORTER_PACKAGE not in off["packages"] and layout.NODE_EXPORTER_UNIT not in off["units"]
    assert set(plain.monitoring.textfiles) <= set(converge.unwanted(plain))  # turned off: sparkform's metrics go
    # A new scrape address changes what node_exporter must run with (its drop-in): a restart.
    moved = watched.model_copy(update={"metrics_allow": ["192.168.1.6"]})
    assert (
        converge.plan(moved, Snapshot()).node_exporter_wanted != converge.plan(watched, Snapshot()).node_exporter_wanted
    )
