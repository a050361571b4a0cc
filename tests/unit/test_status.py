"""`sparkform status`: what it reads from a host's answer, what it leaves out, the table, the
documented JSON and the exit code. Reading a real sandbox: tests/integration/test_watchful.py."""

from __future__ import annotations

import copy
import datetime
import json
import shlex
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from samples import SERVED_PAIR

from sparkform import cli
from sparkform.domain.schema_sections import FrontTLS
from sparkform.readers.remote import LINK, SECTION
from sparkform.reports import status, status_schema
from sparkform.reports.status_table import format_status
from sparkform.rules.front_tls import make_self_signed

REPO = Path(__file__).resolve().parents[2]
SCHEMA_DOC = REPO / "docs" / "status.md"
INVENTORIES = REPO / "tests" / "fixtures" / "inventories"
T0 = 1_764_550_000


GB10_REPORT = json.dumps(
    {
        "driver": "580.95.05",
        "gpus": [
            {"index": 0, "name": "NVIDIA GB10", "utilization_percent": 96, "sm_clock_mhz": 2418, "temperature_c": 61,
             "power_w": 41.3, "throttle_reasons": ["sw_power_cap"], "memory_used_bytes": None}
        ],
        "error": None,
    }
)  # fmt: skip


def metrics(model: str, generated: float, running: int = 1, waiting: int = 0, kv_use: float = 0.25) -> list[str]:
    """/metrics lines as vLLM 0.32 writes them (grep'd to the names status reads)."""
    labels = f'engine="0",model_name="{model}"'
    return [
        'vllm:cache_config_info{block_size="128",kv_cache_size_tokens="1048576",num_gpu_blocks="8192"} 1.0',
        f"vllm:kv_cache_usage_perc{{{labels}}} {kv_use}",
        f"vllm:num_requests_running{{{labels}}} {running}.0",
        f"vllm:num_requests_waiting{{{labels}}} {waiting}.0",
        f"vllm:generation_tokens_total{{{labels}}} {generated}",
    ]


def units(q38: dict[str, str] | None = None) -> list[str]:
    def block(unit: str, **over: str) -> list[str]:
        properties = {
            "Id": unit, "LoadState": "loaded", "ActiveState": "active", "SubState": "running", "NRestarts": "2",
            "MainPID": "4242", "ExecMainStatus": "0", "Result": "success", "UnitFileState": "enabled",
            "ExecMainStartTimestamp": f"@{T0 - 600}", "ExecMainStartTimestampMonotonic": "100000000",
            "ActiveEnterTimestampMonotonic": "131500000", "MemoryCurrent": str(3 * 1024**3),
            "MemoryHigh": str(105 * 1024**3), "MemoryMax": "infinity", "StateChangeTimestamp": f"@{T0 - 570}",
        }  # fmt: skip
        properties.update(over)
        return [f"{key}={value}" for key, value in properties.items()] + [""]

    return block("vllm-nemotron.service") + block("vllm-q38.service", **(q38 or {}))


def services(**states: str) -> list[str]:
    """systemctl show -p Id,ActiveState,SubState of the guard, the front and the scrub timer."""
    lines = []
    for unit in status.SERVICE_UNITS:
        active, sub = states.get(unit, "active/running").split("/")
        lines += [f"Id={unit}", f"ActiveState={active}", f"SubState={sub}", ""]
    return lines


def answer(**sections: list[str]) -> list[str]:
    """A host's answer to status_command: each section under its marker."""
    base = {
        "clock": [f"{T0}.000000000"],
        "metrics:nemotron": metrics("nemotron", 1000),
        "restarts:nemotron": ["3"],
        "health:nemotron": ["200"],
        "metrics:q38": metrics("q38", 500),
        "restarts:q38": ["0"],
        "health:q38": ["200"],
        "clock2": [f"{T0 + 2}.000000000"],
        "metrics2:nemotron": metrics("nemotron", 1084),
        "metrics2:q38": metrics("q38", 500),
        "units": units(),
        "meminfo": ["MemTotal:       125513944 kB", "MemAvailable:   45513944 kB"],
        "gpu": [GB10_REPORT],
        "vllm:0": ["0.27.1"],
        "versions": ["kernel=6.11.0-1016-nvidia", "driver=580.95.05", "gpu_arch=12.1"],
        "record": [],
        "cache_keys": [],
        "watchdog": [],
        "front:nemotron": ["200"],
        "front:q38": ["200"],
        "launch:nemotron": ["loading"],
        "launch:q38": ["loading"],
        "front_key": ["kept"],
        "services": services(),
    }
    base.update({name.replace("__", ":"): lines for name, lines in sections.items()})
    return [line for name, lines in base.items() for line in (f"{SECTION}{name}", *lines)]


@pytest.fixture
def spark(make_host, seed_data):
    return make_host(seed_data, name="spark")


def test_a_serving_pair_is_read_whole(spark):
    s = status.read_status("spark", spark.config, answer(), checked_at=T0)
    assert s.serving and s.untrusted == []
    nemotron, q38 = s.engines
    assert (nemotron.name, nemotron.unit, nemotron.serving, nemotron.restarts, nemotron.main_pid) == (
        "nemotron", "vllm-nemotron.service", True, 3, 4242,
    )  # fmt: skip
    limits = (nemotron.memory_bytes, nemotron.memory_high_bytes, nemotron.memory_max_bytes)
    assert limits == (3 * 1024**3, 105 * 1024**3, None)
    assert nemotron.served_names == ["nemotron"] and nemotron.kv_pool_tokens == 1048576 and nemotron.kv_use == 0.25
    assert (nemotron.requests_running, nemotron.requests_waiting) == (1, 0)
    assert q38.restarts == 0  # the journal's count this boot, not NRestarts (reset once an engine serves)
    assert nemotron.generation_tokens_per_s == 42.0 and q38.generation_tokens_per_s == 0.0
    assert (nemotron.since, nemotron.last_start_at, nemotron.last_start_s) == (T0 - 570, T0 - 600, 31.5)
    assert s.mem_available_bytes == 45513944 * 1024 and s.unified_in_use_bytes == 80000000 * 1024
    assert s.vllm_version == "0.27.1" and nemotron.vllm_version == q38.vllm_version == "0.27.1"
    assert s.gpu.driver == "580.95.05" and s.gpu.gpus[0].throttle_reasons == ("sw_power_cap",)


def test_each_engine_shows_the_vllm_of_its_own_venv(make_host, seed_data):
    """An engine on a vLLM of its own is read from its venv; the host's line keeps the host's."""
    seed_data["engines"][1]["vllm_version"] = "0.33.0"
    config = make_host(seed_data, name="spark").config
    command = status.status_command(config, 2)
    assert f"{shlex.quote(config.pin(config.engines[1]).venv + '/bin/python')} -I -c" in command
    assert "vllm-0.33.0-" in config.pin(config.engines[1]).venv and config.pin(config.engines[0]).venv == config.venv
    read = status.read_status("spark", config, answer(vllm__1=["0.33.0"]), checked_at=T0)
    assert (read.vllm_version, [e.vllm_version for e in read.engines]) == ("0.27.1", ["0.27.1", "0.33.0"])
    rows = [line.split()[:2] for line in format_status(read).splitlines() if line.startswith(("nemotron ", "q38 "))]
    assert rows == [["nemotron", "0.27.1"], ["q38", "0.33.0"]]
    # Its venv not built yet (no answer) or an answer of another shape: no version, nothing taken from it.
    unread = status.read_status("spark", config, answer(vllm__1=["0.33.0; rm -rf /"]), checked_at=T0)
    assert [e.vllm_version for e in unread.engines] == ["0.27.1", None]
    # A disabled engine's venv is never built: not read, no version.
    seed_data["engines"][1]["enabled"] = False
    disabled = make_host(seed_data, name="spark").config
    assert "vllm-0.33.0-" not in status.status_command(disabled, 2)
    read = status.read_status("spark", disabled, answer(vllm__1=["0.33.0"]), checked_at=T0)
    assert [e.vllm_version for e in read.engines] == ["0.27.1", None]


def test_engines_serving_from_a_venv_that_does_not_run_are_a_problem_named_with_its_fix(spark):
    """The venv's python gone (no version read): both engines still serve, but neither would start
    again; status says so (and exits 1: a problem)."""
    s = status.read_status("spark", spark.config, answer(vllm__0=[]), checked_at=T0)
    assert [e.serving for e in s.engines] == [True, True] and s.serving
    venv = spark.config.venv
    assert [p for p in s.problems if "venv" in p] == [
        f"{name}: its venv {venv} does not run (no vLLM version from its python), so its next start fails; "
        "the deploy installs it again: pyinfra INVENTORY deploy.py"
        for name in ("nemotron", "q38")
    ]


def test_a_missing_front_key_file_is_a_problem_named_with_its_fix(make_host, seed_data, tmp_path):
    """The owner removed the front's key file: clients are still served (nginx keeps the keys it
    loaded), but its next reload or restart fails; status says so and exits 1."""
    key = tmp_path / "api-key"
    key.write_text("k" * 32 + "\n")
    key.chmod(0o600)
    seed_data["api_key_file"] = str(key)
    config = make_host(seed_data, name="spark").config
    assert f"[ -f {config.paths.front_key} ] && [ ! -L " in status.status_command(config, 2)
    s = status.read_status("spark", config, answer(front_key=["missing"]), checked_at=T0)
    assert s.serving and [p for p in s.problems if "key file" in p] == [
        f"the front's key file {config.paths.front_key} is missing: nginx serves the keys it loaded, but its "
        "next reload or restart fails; the deploy writes it again: pyinfra INVENTORY deploy.py"
    ]
    assert not [p for p in status.read_status("spark", config, answer(), checked_at=T0).problems if "key" in p]


def test_an_engine_down_or_not_answering_makes_the_host_not_serving(spark):
    failed = units({"ActiveState": "failed", "SubState": "failed", "MainPID": "0", "Result": "start-limit-hit"})
    s = status.read_status("spark", spark.config, answer(units=failed, health__q38=["000"]), checked_at=T0)
    assert not s.serving and [e.serving for e in s.engines] == [True, False]
    assert s.engines[1].health_http is None and s.engines[1].active_state == "failed"
    hung = status.read_status("spark", spark.config, answer(health__q38=["503"]), checked_at=T0)
    assert not hung.serving and hung.engines[1].active_state == "active" and hung.engines[1].health_http == 503
    assert "NOT SERVING: q38" in format_status(hung) and "/health 503" in format_status(hung)


def test_a_disabled_engine_does_not_count(make_host, seed_data):
    seed_data["engines"][1]["enabled"] = False
    host = make_host(seed_data, name="spark")
    failed = units({"ActiveState": "inactive", "SubState": "dead", "MainPID": "0"})
    s = status.read_status("spark", host.config, answer(units=failed, health__q38=["000"]), checked_at=T0)
    assert s.serving and not s.engines[1].enabled
    assert "(disabled)" in format_status(s)


def test_a_front_passing_no_keyed_request_is_named_and_not_serving(spark):
    broken = answer(front__q38=["000"], services=services(**{"nginx.service": "activating/auto-restart"}))
    s = status.read_status("spark", spark.config, broken, checked_at=T0)
    assert all(e.serving for e in s.engines) and not s.serving
    assert "nginx.service does not pass a keyed request to q38, which serves (port 8011: no answer)" in s.problems
    assert "nginx.service is activating/auto-restart" in s.problems
    table = format_status(s)
    assert table.startswith("spark: NOT SERVING CLIENTS") and "nginx.service activating/auto-restart" in table


def test_a_service_state_systemd_never_prints_is_left_out_and_named(spark):
    planted = answer(services=services(**{"nginx.service": "active/$(reboot)"}))
    s = status.read_status("spark", spark.config, planted, checked_at=T0)
    assert "nginx.service" not in [u.unit for u in s.services] and "$(reboot)" not in format_status(s)
    assert "the state of nginx.service in a shape systemd never prints" in s.untrusted
    assert "nginx.service is not read" in s.problems


def test_a_stopped_guard_is_a_problem_while_the_engines_serve(spark):
    s = status.read_status(
        "spark", spark.config, answer(services=services(**{"sparkform-guard.service": "inactive/dead"})), checked_at=T0
    )
    assert s.serving and s.problems == ["sparkform-guard.service is inactive/dead"]
    assert "problem: sparkform-guard.service is inactive/dead" in format_status(s)


def test_an_engine_waiting_its_turn_says_for_whom(spark):
    starting = units({"ActiveState": "activating", "SubState": "start-post"})
    s = status.read_status("spark", spark.config, answer(units=starting, launch__q38=["waiting nemotron"]))
    assert s.engines[1].launch == "waiting nemotron" and "(waits for nemotron)" in format_status(s)
    hostile = answer(units=starting, launch__q38=["waiting ../../etc"])
    assert status.read_status("spark", spark.config, hostile).engines[1].launch is None


def test_tokens_per_second_is_none_across_a_restart_or_with_one_sample(spark):
    restarted = answer(metrics2__nemotron=metrics("nemotron", 12))
    assert status.read_status("spark", spark.config, restarted).engines[0].generation_tokens_per_s is None
    unsampled = answer(metrics2__nemotron=[])
    assert status.read_status("spark", spark.config, unsampled).engines[0].generation_tokens_per_s is None


def test_kv_pool_from_blocks_without_size_label_and_old_use_name_is_read(spark):
    older = [
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="168975"} 1.0',
        'vllm:gpu_cache_usage_perc{model_name="nemotron"} 0.5',
    ]
    e = status.read_status("spark", spark.config, answer(metrics__nemotron=older)).engines[0]
    assert (e.kv_pool_tokens, e.kv_use, e.requests_running) == (16 * 168975, 0.5, None)


def test_values_in_a_shape_never_written_are_left_out_and_named(spark):
    hostile = answer(
        metrics__nemotron=["vllm:num_requests_running{} -1", "vllm:kv_cache_usage_perc{} 7"],
        vllm__0=["0.27.1; rm -rf /"],
        cache_keys=["/var/lib/sparkform/record/cache-keys/q38:k;touch /tmp/pwned"],
        record=[f"{LINK}/var/lib/sparkform/record/host-record.json"],
        watchdog=[json.dumps({"__REALTIME_TIMESTAMP": "1", "MESSAGE": "\x1b[2Jgone", "SPARKFORM_EVENT": "hung"})],
        meminfo=["MemTotal: lots kB"],
        gpu=[GB10_REPORT.replace("NVIDIA GB10", "GB10\\u001b[2J")],
    )
    s = status.read_status("spark", spark.config, hostile, checked_at=T0)
    nemotron = s.engines[0]
    assert nemotron.kv_use is None and nemotron.requests_running is None
    assert s.vllm_version is None and s.mem_total_bytes is None and s.watchdog == []
    assert any(line.startswith("/var/lib/sparkform/record/cache-keys/q38 holds 'k;touch") for line in s.untrusted)
    assert any("host-record.json is a symbolic link" in line for line in s.untrusted)
    assert any("watchdog journal entry" in line for line in s.untrusted)
    assert s.gpu is None and any(line.startswith("the GPU report: gpus[0].name") for line in s.untrusted)
    table = format_status(s, wide=True)
    assert "\x1b" not in table and "rm -rf" not in table
    # a left-out value appears only quoted, on the line that says it was left out
    assert [line for line in table.splitlines() if "pwned" in line] == [
        "left out (untrusted): /var/lib/sparkform/record/cache-keys/q38 holds 'k;touch /tmp/pwned', "
        "which is not a cache key"
    ]


def test_watchdog_alerts_and_drift_since_the_record_are_shown(spark):
    record = {
        "versions": {"kernel": "6.11.0-1016-nvidia", "driver": "580.82.09", "cuda": None, "gpu_arch": "12.1",
                     "firmware": None, "vllm": "vllm-0.27.1"},
        "engines": {"q38": {"cache_key": "driver580.82.09-cudanone-vllm-0.27.1-sm12.1", "cold_start_s": 335.0,
                            "start_s": 40.0}},
    }  # fmt: skip
    entry = {
        "__REALTIME_TIMESTAMP": f"{T0 - 60}000000", "MESSAGE": "vllm-q38.service answered none of 3 probes: killed",
        "SPARKFORM_EVENT": "hung", "SPARKFORM_ENGINE": "q38",
    }  # fmt: skip
    s = status.read_status(
        "spark",
        spark.config,
        answer(
            record=json.dumps(record).splitlines(),
            cache_keys=["/var/lib/sparkform/record/cache-keys/q38:driver580.82.09-cudanone-vllm-0.27.1-sm12.1"],
            watchdog=[json.dumps(entry)],
        ),
        checked_at=T0,
    )
    assert s.engines[1].recorded_cold_start_s == 335.0
    assert s.drift == ["driver 580.82.09 -> 580.95.05: JIT caches of q38 will be rebuilt (cold start, about 335 s)"]
    assert [(w.engine, w.event, w.at) for w in s.watchdog] == [("q38", "hung", T0 - 60)]
    table = format_status(s)
    assert "drift since the record: driver 580.82.09 -> 580.95.05" in table
    assert "q38 hung: vllm-q38.service answered none of 3 probes: killed" in table


def test_a_pooling_engine_shows_its_kind_in_the_json_and_the_table(make_host, seed_data):
    next(e for e in seed_data["engines"] if e["name"] == "q38").update(
        kind="embed", served_names=["q38"], multimodal=False, tool_call_parser=None
    )
    s = status.read_status("spark", make_host(seed_data, name="spark").config, answer(), checked_at=T0)
    assert [(e.name, e.kind) for e in s.engines] == [("nemotron", "generate"), ("q38", "embed")]
    rows = format_status(s).splitlines()
    assert any(line.startswith("q38 (embed) ") for line in rows) and any(line.startswith("nemotron ") for line in rows)


def test_the_table_shows_each_engine_on_one_row(spark):
    table = format_status(status.read_status("spark", spark.config, answer(), checked_at=T0), wide=True)
    head, *_ = table.splitlines()
    assert head.startswith("spark: serving   memory: 43.4 GiB available of 119.7 GiB (76.3 GiB in use")
    row = next(line for line in table.splitlines() if line.startswith("nemotron "))
    assert "GPU 0 NVIDIA GB10: driver 580.95.05, util 96%, SM 2418 MHz, 61 C, 41.3 W, throttle: sw_power_cap" in table
    for cell in (
        "active/running",
        "9m ago",
        "3",
        "4242",
        "3.0 / 105.0 / -",
        "1,048,576",
        "25%",
        "42.0",
        "32 s (10m ago)",
    ):
        assert cell in row, cell


def test_fronts_certificate_fingerprint_is_read_and_other_shapes_left_out(spark):
    config = spark.config.model_copy(update={"front_tls": FrontTLS(enabled=True)})
    assert "front-tls.pem" in status.status_command(config, 1)
    assert "front-tls.pem" not in status.status_command(spark.config, 1)  # plain HTTP: nothing to read
    made = make_self_signed(["spark"], datetime.datetime.now(datetime.UTC))
    read = status.read_status("spark", config, answer(front_certificate=made.pem.splitlines()), checked_at=T0)
    assert read.front_tls == made.fingerprint and not read.untrusted
    assert f"\n  {made.fingerprint}\n" in format_status(read) + "\n"
    planted = status.read_status("spark", config, answer(front_certificate=["$(id)"]), checked_at=T0)
    assert planted.front_tls is None and planted.untrusted


def test_the_json_is_the_documented_schema(spark):
    documented = SCHEMA_DOC.read_text().split("```json\n", 1)[1].split("```", 1)[0]
    assert json.loads(documented) == status_schema.HostStatus.model_json_schema(), (
        "regenerate the schema in docs/status.md with `sparkform status --schema`"
    )
    for s in (
        status.read_status("spark", spark.config, answer(), checked_at=T0),
        status.unreachable("spark", "does not answer over SSH (Connection refused)"),
    ):
        jsonschema.validate(json.loads(s.model_dump_json()), json.loads(documented))


def test_the_command_runs_in_one_shell_and_reads_this_machine_for_real(make_host, seed_data, servers, socket_dir):
    """Two engines answer /health on their sockets here (200 and 503) and no unit exists: the
    command ends, and reads what there is."""
    seed_data["socket_dir"] = str(socket_dir)
    for engine in seed_data["engines"]:
        (socket_dir / engine["name"]).mkdir()
    up, dying = (
        servers(health=health, uds=socket_dir / engine["name"] / "api.sock")
        for engine, health in zip(seed_data["engines"], (200, 503), strict=True)
    )
    host = make_host(seed_data, name="spark")
    command = status.status_command(host.config, 0.1)
    assert command.count("curl -sS") == 4 and "sleep 0.1 ;" in command
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    s = status.read_status("spark", host.config, result.stdout.splitlines())
    assert [e.health_http for e in s.engines] == [200, 503]
    assert not s.serving  # no unit is active here
    assert s.mem_total_bytes == int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    assert up.paths() == ["/metrics", "/health", "/metrics"]


@pytest.mark.parametrize("option", [["--watch", "0"], ["--sample", "-1"], ["--sample", "nan"]])
def test_intervals_that_are_not_positive_are_refused(option, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["status", str(SERVED_PAIR), *option])
    assert exit_.value.code == 2
    assert "must be a positive number of seconds" in capsys.readouterr().err


def unreachable_inventory(tmp_path: Path, port: int) -> Path:
    inventory = tmp_path / "unreachable.py"
    inventory.write_text(
        "import runpy\n"
        "from sparkform.rules.inventory import hosts\n"
        f"pair = runpy.run_path({str(INVENTORIES / 'broken_base.py')!r})['pair']()\n"
        f"pair.update(ssh_hostname='127.0.0.1', ssh_port={port})\n"
        "spark = hosts({'gone-box': pair}, __file__)\n"
    )
    return inventory


def test_a_host_that_does_not_answer_is_named_in_one_line_and_exits_1(tmp_path, free_port, capsys):
    inventory = unreachable_inventory(tmp_path, free_port())
    assert cli.main(["status", str(inventory)]) == 1
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("gone-box: NOT READ: does not answer over SSH (") and "Connection refused" in line
    assert cli.main(["status", str(inventory), "--json"]) == 1
    (document,) = capsys.readouterr().out.splitlines()
    assert json.loads(document)["reachable"] is False


def test_watch_reads_again_every_interval_until_stopped(tmp_path, free_port):
    inventory = unreachable_inventory(tmp_path, free_port())
    command = [sys.executable, "-m", "sparkform.cli", "status", str(inventory), "--json", "--watch", "0.2"]
    watch = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        rounds = [json.loads(watch.stdout.readline()) for _ in range(3)]
    finally:
        watch.kill()
        watch.wait()
    assert [r["host"] for r in rounds] == ["gone-box"] * 3
    assert rounds[0]["checked_at"] < rounds[1]["checked_at"] < rounds[2]["checked_at"]


def test_a_headless_rank_serves_while_its_unit_runs_and_says_whose_it_is(make_host, seed_data):
    """q38 spans spark-a (its head) and this host: here it runs rank 1 without an API, so its
    /health never answers; it counts as serving while its unit is active with a process."""
    data = copy.deepcopy(seed_data)
    q38 = next(engine for engine in data["engines"] if engine["name"] == "q38")
    q38.update(nodes=["spark-a", "spark"], checkpoint={**q38["checkpoint"], "revision": "3f1c" * 10})
    q38.pop("after", None)
    worker = make_host({**data, "node_interface": "cx7"}, name="spark").config
    silent = {"health__q38": ["000"], "metrics__q38": [], "metrics2__q38": []}
    s = status.read_status("spark", worker, answer(**silent), checked_at=T0)
    nemotron, rank = s.engines
    assert (nemotron.rank, rank.rank, rank.serving, rank.health_http) == (0, 1, True, None) and s.serving
    assert "active/running (rank 1, headless)" in format_status(s, wide=True)
    down = units({"ActiveState": "failed", "MainPID": "0"})
    stopped = status.read_status("spark", worker, answer(**silent, units=down), checked_at=T0)
    assert not stopped.serving and not stopped.engines[1].serving


def test_by_default_status_fits_100_columns_and_wide_shows_every_column(spark):
    """The narrow table keeps what a glance needs; long lines (a problem, an alert) wrap."""
    entry = {
        "__REALTIME_TIMESTAMP": f"{T0 - 60}000000", "MESSAGE": "vllm-q38.service stopped: " + "why " * 60,
        "SPARKFORM_EVENT": "stopped", "SPARKFORM_ENGINE": "q38",
    }  # fmt: skip
    read = status.read_status("spark", spark.config, answer(watchdog=[json.dumps(entry)]), checked_at=T0)
    narrow, wide = format_status(read), format_status(read, wide=True)
    assert max(len(line) for line in narrow.splitlines()) <= 100, narrow
    assert max(len(line) for line in wide.splitlines()) > 100
    heading = next(line for line in narrow.splitlines() if line.startswith("ENGINE"))
    assert heading.split() == [
        "ENGINE",
        "VLLM",
        "STATE",
        "SINCE",
        "RESTARTS",
        "KV",
        "USE",
        "RUN",
        "WAIT",
        "TOK/S",
        "LAST",
        "START",
    ]
    row = next(line for line in narrow.splitlines() if line.startswith("nemotron "))
    assert row.split()[:3] == ["nemotron", "0.27.1", "active"] and "25%" in row and "42.0" in row
    assert "why why" in narrow and "KV POOL tokens" in wide and "MEMORY GiB now/high/max" in wide
