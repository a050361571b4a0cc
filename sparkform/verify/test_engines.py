"""What a converged host must look like, read from systemd, the files and the live endpoints."""

from __future__ import annotations

import ipaddress
import json
import re
import shlex

import pytest

from sparkform.commands.contract import KEYS_FROM_SNIPPET, key_header
from sparkform.domain.layout import (
    CHECKPOINT_MANIFEST,
    COMPLETE_MARKER,
    ENGINES_TARGET,
    FRONT_USER,
    KEPT_FILES,
    KEPT_RECORD,
    ROOT_PYTHON,
    SCRUB_TIMER,
    UNIT_PREFIX,
    cache_keys_dir,
    engine_socket_dir,
    record_dir,
    record_path,
    venv_marker,
)
from sparkform.readers.hostrecord import HostRecord
from sparkform.readers.kept import KeptSettings, settings_digest
from sparkform.readers.parsers import parse_kv_pool
from sparkform.rules import bootchain
from sparkform.writers.render import VLLM_UNGUARDED_ROUTES, engine_environment

UNIT_LIMITS_USEC = re.compile(r"^(\d+)")


def _seconds(systemd_timespan: str) -> float:
    """'20min', '1h', '18min 20s', '1.500s' -> seconds (systemctl show's human timespans)."""
    units = {"h": 3600, "min": 60, "s": 1, "ms": 0.001, "us": 1e-6}
    total = 0.0
    for number, unit in re.findall(r"([\d.]+)(h|min|ms|us|s)", systemd_timespan):
        total += float(number) * units[unit]
    return total


def _curl(
    remote,
    config,
    engine,
    path: str,
    data: dict | None = None,
    key: bool = True,
    status_only: bool = False,
    port: int | None = None,
) -> str:
    """Ask the engine through the front (its own port, or `port`), from the host itself, as a
    client would; the API key (if any) is read from the front's snippet there and handed to curl
    on a pipe, never in argv."""
    body = f"-H 'Content-Type: application/json' -d '{json.dumps(data)}'" if data else ""
    header = key_header(config.paths.front_key) if key else ""
    url = config.front_url(port or engine.port, path)
    output = "-s -o /dev/null -w '%{http_code}'" if status_only else "-fsS"
    script = f"curl {output} --max-time 30 {config.front_curl_tls} {header} {body} {url}"
    return remote.check_output("bash -c %s", script)


def _exec_start_post(remote, engine) -> str:
    """Every ExecStartPost= of the unit (testinfra's property dict keeps only the last one)."""
    return remote.check_output(f"systemctl show -p ExecStartPost {engine.unit}")


def test_unit_enabled_and_active(remote, engine):
    service = remote.service(engine.unit)
    assert service.is_enabled, f"{engine.unit} is not enabled at boot"
    assert service.is_running, f"{engine.unit} is not running"


def test_restart_policy_and_burst_limit(remote, engine, config):
    props = remote.service(engine.unit).systemd_properties
    assert props["Restart"] == "always", "an engine can die with exit 0 (docs/incidents.md#exit-0-crash)"
    assert int(props["StartLimitBurst"]) == config.start_limit_burst
    assert _seconds(props["StartLimitIntervalUSec"]) == config.start_limit_interval_s


def test_memory_ceilings(remote, engine, config):
    props = remote.service(engine.unit).systemd_properties
    assert int(props["MemoryHigh"]) == int(config.memory_high_gib * 1024) * 2**20
    assert int(props["MemoryMax"]) == int(config.memory_max_gib * 1024) * 2**20
    assert int(props["MemoryMax"]) > int(props["MemoryHigh"])


def test_start_timeout_above_readiness_budget(remote, engine, config):
    props = remote.service(engine.unit).systemd_properties
    assert _seconds(props["TimeoutStartUSec"]) > config.readiness_budget_s
    # The helper asks what the engine's kind serves (a completion, an embedding, a rerank).
    probe = f"--probe {engine.probe['route']} {json.dumps(engine.probe['body'], sort_keys=True)}"
    helper = f"sparkform-wait-ready {probe} {config.engine_socket(engine)} {config.readiness_budget_s}"
    assert helper in _exec_start_post(remote, engine)


def test_caps_path_and_cuda_in_unit_environment(remote, engine, config):
    environment = dict(
        item.split("=", 1) for item in remote.service(engine.unit).systemd_properties["Environment"].split()
    )
    expected = engine_environment(config, engine)
    for key in (
        "MAX_JOBS",
        "NVCC_THREADS",
        "FLASHINFER_NVCC_THREADS",
        "TORCHINDUCTOR_COMPILE_THREADS",
        "CUDA_HOME",
        "VLLM_CACHE_ROOT",
        "FLASHINFER_WORKSPACE_BASE",
    ):
        assert environment.get(key) == expected[key], key
    assert environment["PATH"].startswith(f"{config.cuda_home}/bin:")


def test_caps_reach_the_running_engine(remote, engine, config):
    pid = remote.service(engine.unit).systemd_properties["MainPID"]
    environ = remote.check_output(f"tr '\\0' '\\n' < /proc/{pid}/environ")
    assert f"MAX_JOBS={config.compile_caps.max_jobs}" in environ.splitlines()


def test_each_engine_runs_from_the_complete_venv_of_its_own_vllm(remote, engine, config):
    """The engine's vLLM (engines[].vllm_version or lock_file, else the host's): its process runs that venv's python,
    and the venv's marker names the pin."""
    pin = config.pin(engine)
    pid = remote.service(engine.unit).systemd_properties["MainPID"]
    argv = remote.check_output(f"tr '\\0' '\\n' < /proc/{int(pid)}/cmdline").splitlines()
    assert argv[0] == f"{pin.venv}/bin/python", argv
    assert remote.file(venv_marker(pin.venv)).content_string.strip() == pin.requirement


def test_after_edges_point_at_enabled_units(remote, engine, config):
    after = tuple(remote.service(engine.unit).systemd_properties.get("After", "").split())
    # Only "enabled" joins the boot transaction; "static" and "disabled" units do not.
    states = {
        unit: remote.run(f"systemctl is-enabled {unit}").stdout.strip()
        for unit in after
        if unit.startswith(UNIT_PREFIX)
    }
    for unit, dep, state in bootchain.holes({engine.unit: after}, states):
        pytest.fail(
            f"{unit} is ordered after {dep}, which is not enabled ({state}): the boot chain has a "
            f"hole (docs/incidents.md#boot-chain-hole); enable {dep} or remove the edge"
        )
    assert set(bootchain.after_units(config, engine)) <= set(after), "an edge of the inventory is missing"


def test_guard_watches_and_every_engine_fails_over_to_its_recovery(remote, engine, config):
    guard = remote.service("sparkform-guard.service")
    assert guard.is_enabled and guard.is_running, "nothing watches the engines' generation and memory"
    settings = remote.file(config.paths.guard_config)
    assert (settings.user, settings.mode) == ("root", 0o644)
    props = remote.service(engine.unit).systemd_properties
    assert props["OnFailure"] == f"sparkform-recover@{engine.name}.service"
    assert f"sparkform-guard served {engine.name}" in _exec_start_post(remote, engine)
    # Every stop passes the guard (an unplanned one is alerted), and systemd watches the guard.
    stop_post = remote.check_output(f"systemctl show -p ExecStopPost {engine.unit}")
    assert f"sparkform-guard stopped {engine.name}" in stop_post, "an unplanned stop of the engine reaches nobody"
    watchdog = remote.check_output("systemctl show -p WatchdogUSec --value sparkform-guard.service")
    assert watchdog not in ("", "0", "infinity"), "nothing restarts a guard that stopped answering"


def test_the_scrub_is_armed_as_the_inventory_says(remote, config):
    timer = remote.service(SCRUB_TIMER)
    if not config.scrub.enabled:
        assert not timer.is_enabled and not timer.is_running, "the inventory turned the scrub off"
        return
    assert timer.is_enabled and timer.is_running, "no scrub re-hashes the checkpoints: bit rot goes unseen"
    # systemd computed when it fires next from the inventory's period.
    assert remote.check_output(f"systemctl show -p NextElapseUSecRealtime --value {SCRUB_TIMER}")
    settings = remote.file(config.paths.scrub_config)
    assert (settings.user, settings.mode) == ("root", 0o644)
    assert json.loads(settings.content_string)["rate_mib_s"] == config.scrub.rate_mib_s


def test_engines_target_enabled_and_reached(remote):
    assert remote.check_output(f"systemctl is-enabled {ENGINES_TARGET}") == "enabled"
    assert remote.check_output(f"systemctl is-active {ENGINES_TARGET} || true") == "active"


def test_host_record_is_roots_and_keys_each_engines_caches(remote, config):
    path = record_path(config.state_dir)
    record = remote.file(path)
    assert (record.user, record.group, record.mode) == ("root", "root", 0o644)
    written = HostRecord.from_json(record.content_string)
    assert written is not None, f"{path} is not a host record"
    for engine in config.enabled_engines:
        key_file = remote.file(f"{cache_keys_dir(config.state_dir)}/{engine.name}")
        assert (key_file.user, key_file.mode) == ("root", 0o644), engine.name
        assert key_file.content_string.strip() == written.engines[engine.name].cache_key, engine.name


def test_each_engine_keeps_the_settings_it_serves(remote, engine, config):
    """What a failed change goes back to (docs/operator.md: rollback): root's alone, the very files the
    engine runs with, on the venv and checkpoint it serves."""
    folder = config.paths.kept(engine.name)
    kept_dir = remote.file(folder)
    assert kept_dir.is_directory and (kept_dir.user, kept_dir.mode) == ("root", 0o700), folder
    kept = KeptSettings.from_json(remote.file(f"{folder}/{KEPT_RECORD}").content_string)
    running = [remote.file(path).content_string for path in config.paths.engine_files(engine.name)]
    copies = [remote.file(f"{folder}/{name}").content_string for name in KEPT_FILES]
    assert copies == running and kept.digest == settings_digest(*running), folder
    assert (kept.venv, kept.checkpoint) == (config.pin(engine).venv, config.checkpoint_dir(engine)), folder


def test_root_reads_back_only_from_root_only_folders(remote, config):
    """The engine user can rename or replace nothing root reads back or runs: every such folder
    and each of its parents up to / is root's and writable by root alone."""
    trusted = [
        record_dir(config.state_dir),
        cache_keys_dir(config.state_dir),
        config.pins_dir,
        config.models_dir,
        config.config_dir,
        config.lib_dir,
        *(pin.venv for pin in config.pins),
        config.cache_root,
    ]
    for path in trusted:
        while path != "/":
            folder = remote.file(path)
            assert folder.is_directory and not folder.is_symlink, path
            assert folder.user == "root" and folder.mode & 0o022 == 0, f"{path}: {folder.user} {folder.mode:o}"
            path = path.rsplit("/", 1)[0] or "/"
    for path in [config.paths.engine_home, config.paths.lock_dir] + [
        config.engine_cache_dir(e) for e in config.engines
    ]:
        assert remote.file(path).user == config.engine_user, path


def test_scripts_installed_with_mode_and_owner(remote, config):
    for name in ("sparkform-launch", "sparkform-wait-ready"):
        script = remote.file(f"{config.lib_dir}/{name}")
        assert script.is_file
        assert script.user == "root" and script.group == "root"
        assert script.mode == 0o755


def test_models_lists_every_served_name(remote, engine, config):
    models = json.loads(_curl(remote, config, engine, "/v1/models"))
    assert {entry["id"] for entry in models["data"]} >= set(engine.names)


def test_each_name_answers_its_kinds_probe(remote, engine, config):
    """Every served name answers what its kind serves, through the front: a one-token completion,
    an embedding (a vector of numbers) or a rerank (a relevance score)."""
    probe = engine.probe
    for name in engine.names:
        answer = json.loads(_curl(remote, config, engine, probe["route"], {**probe["body"], "model": name}))
        assert answer[probe["answer"]], answer
        if engine.kind == "generate":
            assert answer["usage"]["completion_tokens"] == 1
        elif engine.kind == "embed":
            vector = answer["data"][0]["embedding"]
            assert vector and all(isinstance(x, float) for x in vector)
            print(f"{engine.name}: embeds into {len(vector)} dimensions")


def test_chat_completion(remote, engine, config):
    if engine.pooling:
        pytest.skip(f"a pooling engine ({engine.kind}) has no chat")
    answer = json.loads(
        _curl(
            remote,
            config,
            engine,
            "/v1/chat/completions",
            {"model": engine.names[-1], "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]},
        )
    )
    assert answer["choices"][0]["message"]["role"] == "assistant"
    assert answer["usage"]["completion_tokens"] >= 1


def test_api_key_guards_the_api(remote, engine, config):
    """With an API key configured, the front refuses /v1 without it (401)."""
    if not config.front_keyed:
        pytest.skip("no api_key_file or api_keys in the inventory")
    assert _curl(remote, config, engine, "/v1/models", key=False, status_only=True) == "401"


def test_front_passes_only_the_engines_routes(remote, engine, config):
    for path in VLLM_UNGUARDED_ROUTES:
        if path == "/metrics" or path in engine.routes:
            continue  # the allowed addresses' (metrics_allow), 403 for everyone else: below
        assert _curl(remote, config, engine, path, status_only=True) == "404", path
    assert _curl(remote, config, engine, "/health", key=False, status_only=True) == "200"
    if "/tokenize" in engine.routes:  # the served model's own token count, with the key only
        count = {"model": engine.names[0], "prompt": "hello"}
        assert _curl(remote, config, engine, "/tokenize", count, status_only=True) == "200"
        assert _curl(remote, config, engine, "/tokenize", count, key=False, status_only=True) == "401"


def test_the_combined_port_sends_each_name_to_its_engine(remote, engine, config):
    """front_port: /v1/models lists this engine's names among every engine's, and a chat for
    each of its names is answered by it (vLLM names it by its first name)."""
    if not config.front_port:
        pytest.skip("front_port is null: no combined port")
    listed = json.loads(_curl(remote, config, engine, "/v1/models", port=config.front_port))
    assert set(engine.names) <= {model["id"] for model in listed["data"]}
    probe = engine.probe
    for name in engine.names:
        body = {**probe["body"], "model": name}
        answer = json.loads(_curl(remote, config, engine, probe["route"], body, port=config.front_port))
        assert answer[probe["answer"]] and answer["model"] == engine.names[0]  # vLLM names it by its first name


def test_front_metrics_to_the_allowed_addresses_only(remote, engine, config):
    """The engine's /metrics through the front: 200 to an address in metrics_allow, 403 to any other."""
    source = ipaddress.ip_address(config.front_local_address)  # where curl on the host comes from
    allowed = any(source in ipaddress.ip_network(network) for network in config.metrics_allow)
    assert _curl(remote, config, engine, "/metrics", key=False, status_only=True) == ("200" if allowed else "403")


def test_engine_serves_on_its_socket_only(remote, engine, config):
    """The engine's API is its unix socket, which only root, the front and the engine's user
    reach; an engine on one host has a network of its own, so none of its processes listens on
    a TCP port of the host (the ranks of one across hosts meet on the link)."""
    if config.is_worker(engine):
        pytest.skip(f"{engine.name}: a rank without an API here")
    socket, folder = config.engine_socket(engine), engine_socket_dir(config.socket_dir, engine.name)
    assert remote.check_output(f"stat -c '%F %a %U %G' {folder}") == f"directory 2750 {config.engine_user} {FRONT_USER}"
    assert remote.check_output(f"stat -c '%F %a %U %G' {socket}") == f"socket 770 {config.engine_user} {FRONT_USER}"
    if not engine.nodes:
        units = [line.split() for line in remote.check_output("ps -eo pid=,unit=").splitlines()]
        pids = [words[0] for words in units if words[1:] == [engine.unit]]
        listeners = remote.check_output("ss -Hltnp")
        assert pids and not [pid for pid in pids if f"pid={pid}," in listeners], listeners
    assert "--disable-fastapi-docs" in remote.file(config.paths.engine_settings(engine.name)[1]).content_string


def test_front_enabled_active_unprivileged_and_its_key_its_and_roots_only(remote, config):
    nginx = remote.service("nginx.service")
    assert nginx.is_enabled and nginx.is_running
    assert remote.run("nginx -t -q").rc == 0
    # Not even its master runs as root.
    users = remote.check_output("ps -o user= -C nginx | sort -u").split()
    assert users == [FRONT_USER], users
    if config.front_keyed:
        snippet = remote.file(config.paths.front_key)
        assert (snippet.user, snippet.group, snippet.mode) == ("root", FRONT_USER, 0o640)
    assert not remote.file(f"{config.config_dir}/secrets/engine.env").exists  # the engines hold no key


def test_kv_pool_read_back(remote, engine):
    journal = remote.check_output(f"journalctl -u {engine.unit} -b --no-pager -o cat")
    pool = parse_kv_pool(journal.splitlines())
    if pool is None and engine.pooling:
        pytest.skip(f"{engine.unit} printed no KV pool: an encoder-only pooling model keeps none")
    assert pool is not None, f"{engine.unit} printed no KV cache size line this boot"
    assert pool.tokens > 0 and pool.max_model_len == engine.max_model_len
    print(f"{engine.name}: {pool.device} KV pool {pool.tokens:,} tokens, {pool.concurrency}x at {pool.max_model_len:,}")


def test_checkpoint_complete_at_pinned_revision(remote, engine, config):
    folder = config.checkpoint_dir(engine)
    assert remote.file(f"{folder}/.sparkform-complete").exists
    assert remote.file(f"{folder}/config.json").exists
    assert config.commit(engine), f"no pin of {engine.checkpoint.pin_name} in {config.pins_dir}"
    # sparkform-checkpoint records the commit whose tree every file was checked against.
    manifest = json.loads(remote.file(f"{folder}/{CHECKPOINT_MANIFEST}").content_string)
    assert (manifest["repo"], manifest["commit"]) == (engine.checkpoint.repo, config.commit(engine)), manifest
    marker = remote.file(f"{folder}/{COMPLETE_MARKER}").content_string.strip()
    assert marker == config.commit(engine), f"the marker of {folder} names {marker}"


def test_checkpoint_files_hash_as_verified(remote, config, request):
    if not request.config.getoption("--deep"):
        pytest.skip("re-hashing runs with --deep")
    # The host's own scrub, reporting only and at full speed: every file of every checkpoint an
    # engine serves against the sha256 its manifest recorded.
    result = remote.run(f"{shlex.join(ROOT_PYTHON)} %s --check-only --rate-mib-s 1000000", config.paths.scrub)
    assert result.rc == 0, f"files differ from their verified sha256:\n{result.stdout}{result.stderr}"


def test_no_secret_in_a_world_readable_file(remote, config):
    # What each file's secret is, as grep patterns: the token's line; each client's key.
    secrets_of = {config.paths.hf_token: "cat", config.paths.front_key: f"sed -n '{KEYS_FROM_SNIPPET}'"}
    for path in secrets_of:
        file = remote.file(path)
        if file.exists:
            assert file.mode & 0o007 == 0, f"{path} is readable by every user"
            # Search with the secret as a pattern file, so it never appears in an argv; a fresh
            # name mktemp makes (0600), never a fixed path another user could plant a link at.
            leaks = remote.run(
                f'umask 077; pattern=$(mktemp); {secrets_of[path]} {path} > "$pattern"; '
                f'grep -rlF -f "$pattern" /etc /usr/local/lib /var/lib/sparkform /opt/sparkform '
                f"/run/systemd 2>/dev/null | while read -r f; do "
                f'[ $(( 0$(stat -c %a "$f") & 4 )) -ne 0 ] && echo "$f"; done; '
                f'journalctl -b --no-pager -o cat | grep -cF -f "$pattern"; rm -f "$pattern"'
            )
            lines = leaks.stdout.split()
            assert lines[-1] == "0", f"the secret of {path} appears in the journal"
            assert lines[:-1] == [], f"world-readable files hold the secret of {path}: {lines[:-1]}"


def test_a_rank_runs_headless_joined_to_its_head(remote, rank, config):
    """A rank > 0 of an engine across hosts: enabled at boot, restarted always, vLLM running as
    this node's rank without an API (no readiness helper of its own), connected to its head."""
    service = remote.service(rank.unit)
    assert service.is_enabled, f"{rank.unit} is not enabled at boot"
    assert service.is_running, f"{rank.unit} is not running"
    props = service.systemd_properties
    assert props["Restart"] == "always", "a rank can die with exit 0 too"
    assert "sparkform-wait-ready" not in _exec_start_post(remote, rank)
    argv = remote.check_output(f"tr '\\0' ' ' </proc/{int(props['MainPID'])}/cmdline")
    assert " serve " in f" {argv} " and "--headless" in argv, argv
    assert f"--node-rank {config.rank(rank)} " in argv and f"--master-port {rank.master_port}" in argv, argv
    env = remote.file(config.paths.engine_settings(rank.name)[0]).content_string
    master = re.search(r"^SPARKFORM_MASTER_ADDRESS=([0-9a-fA-F.:]+)$", env, re.MULTILINE)
    assert master, "the rank's settings name no head address"
    assert remote.check_output(f"ss -Htn state established dst {master.group(1)}"), "no connection to the head"
