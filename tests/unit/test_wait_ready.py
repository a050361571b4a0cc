"""sparkform-wait-ready, the readiness helper each engine unit runs after its start, rendered for a
small host in tmp_path (script_box.Box) and run with bash against stand-in engines on the engine's
unix socket: every served name, the health check and a one-token warm-up; a budget in wall-clock
time even against a socket that never answers; an early exit once the engine's main process died;
no belief in a listener outside the helper's own cgroup.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from suite_hygiene import temp_folder

from sparkform.domain.layout import unit_path
from sparkform.sandbox.cgroups import kill_cgroup, own_cgroups, remove_cgroup


def test_wait_ready_succeeds_when_every_name_is_served(make_box, servers):
    box = make_box()
    engine = servers(uds=box.socket("a"), names=("a", "a-alias", "other"))
    result, elapsed = box.run_wait_ready(str(box.socket("a")), "10", "a", "a-alias")
    assert result.returncode == 0, result.stderr
    assert elapsed < 5
    assert f"{box.socket('a')} serves a a-alias" in result.stderr
    assert engine.paths("GET")[:2] == ["/health", "/v1/models"]
    # One warm-up token through the whole engine, for the first name.
    (completion,) = [r for r in engine.requests if r["path"] == "/v1/completions"]
    body = json.loads(completion["body"])
    assert body["model"] == "a" and body["max_tokens"] == 1


def test_wait_ready_accepts_compact_json(make_box, servers):
    box = make_box()
    servers(uds=box.socket("a"), names=("a",), compact=True)
    result, _ = box.run_wait_ready(str(box.socket("a")), "10", "a")
    assert result.returncode == 0, result.stderr


def test_wait_ready_keeps_waiting_for_a_missing_name_and_fails_at_budget(make_box, servers):
    box = make_box()
    engine = servers(uds=box.socket("a"), names=("a",))
    result, elapsed = box.run_wait_ready(str(box.socket("a")), "3", "a", "vision")
    assert result.returncode == 1
    assert 3 <= elapsed < 5
    assert engine.paths("GET").count("/v1/models") >= 3  # it kept polling
    assert "/v1/completions" not in engine.paths("POST")
    assert f"{box.socket('a')} did not serve a vision within 3 s" in result.stderr


def test_wait_ready_matches_whole_names_only(make_box, servers):
    box = make_box()
    servers(uds=box.socket("a"), names=("ab", "xa"))
    result, _ = box.run_wait_ready(str(box.socket("a")), "2", "a")
    assert result.returncode == 1


def test_wait_ready_matches_names_literally(make_box, servers):
    box = make_box()
    servers(uds=box.socket("a"), names=("q3x8",))
    result, _ = box.run_wait_ready(str(box.socket("a")), "2", "q3.8")
    assert result.returncode == 1  # "." is no wildcard
    servers(uds=box.socket("b"), names=("org/model(v2)+x", "x[1]", "a|b", "q3.8"))
    result, _ = box.run_wait_ready(str(box.socket("b")), "10", "q3.8", "org/model(v2)+x", "x[1]", "a|b")
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stderr


@pytest.mark.parametrize(("health", "completion"), [(503, 200), (200, 500)])
def test_wait_ready_fails_while_health_or_warmup_fails(make_box, servers, health, completion):
    box = make_box()
    servers(uds=box.socket("a"), names=("a",), health=health, completion=completion)
    result, elapsed = box.run_wait_ready(str(box.socket("a")), "2", "a")
    assert result.returncode == 1
    assert 2 <= elapsed < 4


def test_wait_ready_budget_is_wall_clock_against_a_stalled_socket(make_box, servers):
    box = make_box()
    staller = servers("staller", uds=box.socket("a"))
    result, elapsed = box.run_wait_ready(str(box.socket("a")), "3", "a")
    assert result.returncode == 1
    assert elapsed < 3 + 2, f"a stalled socket stretched the 3 s budget to {elapsed:.1f} s"
    assert staller.conns, "the helper never connected"


@pytest.mark.parametrize("left", ["nothing", "a dead socket"])
def test_wait_ready_fails_at_the_budget_without_a_server(make_box, left):
    """No socket yet, or the one a killed engine left (nobody listens): no answer, to the budget."""
    box = make_box()
    if left == "a dead socket":
        with socket.socket(socket.AF_UNIX) as dead:
            dead.bind(str(box.socket("a")))
    result, elapsed = box.run_wait_ready(str(box.socket("a")), "2", "a")
    assert result.returncode == 1
    assert 2 <= elapsed < 3.5
    assert f"{box.socket('a')} did not serve a within 2 s" in result.stderr


@pytest.mark.parametrize("kind", ["none", "staller"])
def test_wait_ready_fails_soon_after_the_main_process_dies(make_box, servers, kind):
    box = make_box()
    if kind == "staller":
        servers("staller", uds=box.socket("a"))
    engine = subprocess.Popen(["sleep", "1"])
    died: list[float] = []

    def reap() -> None:  # reap it at once, or kill -0 would still find the zombie
        engine.wait()
        died.append(time.monotonic())

    reaper = threading.Thread(target=reap)
    reaper.start()
    result, elapsed = box.run_wait_ready(str(box.socket("a")), "30", "a", MAINPID=str(engine.pid))
    end = time.monotonic()
    reaper.join()
    assert result.returncode == 1
    assert f"engine main process {engine.pid} died" in result.stderr
    assert end - died[0] < 2.5, f"noticed the death {end - died[0]:.1f} s late"
    assert elapsed < 5


def test_wait_ready_with_a_live_main_process_still_succeeds(make_box, servers):
    box = make_box()
    servers(uds=box.socket("a"), names=("a",))
    result, _ = box.run_wait_ready(str(box.socket("a")), "10", "a", MAINPID=str(os.getpid()))
    assert result.returncode == 0, result.stderr


def test_wait_ready_takes_a_main_process_it_may_not_signal_as_alive(make_box, servers):
    """Run as the engine user, the helper can start while the main process is still systemd's
    (root's) child setting up the sandbox: kill -0 is refused then, and that is no death."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run the helper as another user")
    box = make_box()
    servers(uds=box.socket("a"), names=("a",))
    # pytest's folders are root's only: the unprivileged user runs a copy from a folder it may read,
    # and reaches the socket as the engine's user does (its folders searchable, the socket writable).
    folder = temp_folder("wait-ready")
    folder.chmod(0o755)
    helper = folder / "sparkform-wait-ready"
    shutil.copy(box.wait_ready, helper)
    sock = box.socket("a")
    for path in (sock.parent.parent, sock.parent):
        path.chmod(0o755)
    sock.chmod(0o666)
    root_owned = subprocess.Popen(["sleep", "30"])  # this test runs as root
    try:
        start = time.monotonic()
        result = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(helper), str(sock), "10", "a"],
            capture_output=True,
            text=True,
            timeout=60,
            env={"PATH": "/usr/bin:/bin", "MAINPID": str(root_owned.pid)},
        )
    finally:
        root_owned.kill()
        root_owned.wait()
        shutil.rmtree(folder)
    assert result.returncode == 0, result.stderr
    assert "died" not in result.stderr and time.monotonic() - start < 10


@pytest.mark.parametrize(
    "args",
    [[], ["/run/x/a.sock"], ["/run/x/a.sock", "10"], ["--probe", "/v1/embeddings"], ["--probe", "/r", "{}", "1", "2"]],
)
def test_wait_ready_usage(make_box, args):
    box = make_box()
    result, elapsed = box.run_wait_ready(*args)
    assert result.returncode == 2
    assert "usage: sparkform-wait-ready [--probe ROUTE BODY] SOCKET BUDGET_S NAME..." in result.stderr
    assert elapsed < 2


def test_a_pooling_engine_is_warmed_with_its_probe_as_its_unit_renders_it(make_box, servers):
    """An embedding engine answers no completion: the unit hands the helper its kind's probe."""
    box = make_box(engine_fields={"b": {"kind": "embed"}})
    unit = box.files[unit_path(box.engine("b").unit)].content
    (line,) = [line for line in unit.splitlines() if line.startswith("ExecStartPost=") and "wait-ready" in line]
    args = shlex.split(line.split("=", 1)[1])[1:]
    assert args[:3] == ["--probe", "/v1/embeddings", json.dumps({"input": "ping", "model": "b"})], args
    assert args[3:] == [str(box.socket("b")), str(box.config.readiness_budget_s), "b"], args
    engine = servers(uds=box.socket("b"), names=("b",), serves=("/v1/embeddings",))
    result, _ = box.run_wait_ready(*args[:4], "10", "b")
    assert result.returncode == 0, result.stderr
    (embedding,) = [r for r in engine.requests if r["method"] == "POST"]
    assert embedding["path"] == "/v1/embeddings" and json.loads(embedding["body"]) == {"input": "ping", "model": "b"}
    # The generator's warm-up, a completion, would never pass it: that engine 404s completions.
    result, _ = box.run_wait_ready(str(box.socket("b")), "2", "b")
    assert result.returncode == 1 and "did not serve b within 2 s" in result.stderr


def test_wait_ready_asks_the_engine_itself_without_a_key(make_box, servers):
    # The helper polls the engine's own socket, where no key is asked for: the engines never hold
    # the key (the front checks it), so the helper has none to send.
    box = make_box()
    engine = servers(uds=box.socket("a"), names=("a",))
    result, _ = box.run_wait_ready(str(box.socket("a")), "10", "a")
    assert result.returncode == 0, result.stderr
    assert [r for r in engine.requests if r["path"] == "/v1/completions"]
    assert not any("Authorization" in r["headers"] for r in engine.requests)


def in_cgroup(folder: Path, *command: str) -> list[str]:
    """`command`, run inside the cgroup (v2) `folder`, as systemd runs a unit's programs in its own."""
    return ["sh", "-c", 'echo $$ >"$0/cgroup.procs" && exec "$@"', str(folder), *command]


@pytest.fixture
def unit_cgroup():
    """A cgroup (v2) of its own under this test's, standing for the engine's unit; gone after."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make a cgroup")
    parents = [folder for folder in own_cgroups() if (folder / "cgroup.controllers").exists()]
    if not parents:
        pytest.skip("no cgroup v2 hierarchy mounted here")
    folder = parents[0] / f"sparkform-test-unit-{uuid.uuid4().hex[:8]}"
    try:
        folder.mkdir()
    except OSError as err:
        pytest.skip(f"cannot make a cgroup here: {err}")
    try:
        joined = subprocess.run(in_cgroup(folder, "true"), capture_output=True, text=True, timeout=10)
        if joined.returncode != 0:
            pytest.skip(f"cannot run a process in a cgroup of its own here: {joined.stderr.strip()}")
        yield folder
    finally:
        kill_cgroup(folder)
        remove_cgroup(folder)


# The stand-in engine as a process of its own (in the unit's cgroup), which holds thousands of open
# files before its socket, as an engine does: it says "ready" once it listens.
ENGINE_PROCESS = """import resource, signal, sys
from pathlib import Path
from script_box import fake_engine
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
want = 4096 if hard == resource.RLIM_INFINITY else min(4096, hard)
resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
files = [open("/dev/null") for _ in range(want - 100)]
fake_engine(uds=Path(sys.argv[1]), names=("a",))
print("ready", flush=True)
signal.pause()
"""


def test_wait_ready_believes_only_a_listener_in_its_own_cgroup(make_box, servers, unit_cgroup):
    """The helper runs in the engine's unit: a server of the API's shape on the socket from outside
    that cgroup (one that bound it before the engine) is named and not believed (exit 3), however
    well it answers, and gets no prompt; the same stand-in from inside the unit is believed, found
    among every process's open files (thousands of its own) within seconds, not a fork for each."""
    box = make_box()
    sock = str(box.socket("a"))
    helper = [str(box.wait_ready), sock, "10", "a"]
    env = {"PATH": "/usr/bin:/bin"}
    stranger = servers(uds=box.socket("a"), names=("a",))  # this test's process: outside the unit
    result = subprocess.run(in_cgroup(unit_cgroup, *helper), capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 3, result.stderr
    assert (
        f"{sock} answers, but from a process outside this unit (pid {os.getpid()}, uid {os.getuid()}): "
        "not this engine, so not believed"
    ) in result.stderr
    assert stranger.paths("GET")[:2] == ["/health", "/v1/models"] and not stranger.paths("POST")
    stranger.close()
    path = os.pathsep.join(entry for entry in sys.path if entry)
    engine = subprocess.Popen(
        in_cgroup(unit_cgroup, sys.executable, "-c", ENGINE_PROCESS, sock),
        stdout=subprocess.PIPE,
        text=True,
        env={**env, "PYTHONPATH": path},
    )
    try:
        assert engine.stdout is not None and engine.stdout.readline() == "ready\n"
        start = time.monotonic()
        result = subprocess.run(in_cgroup(unit_cgroup, *helper), capture_output=True, text=True, timeout=60, env=env)
        elapsed = time.monotonic() - start
    finally:
        engine.kill()
        engine.wait()
    assert result.returncode == 0, result.stderr
    assert f"{sock} serves a" in result.stderr and elapsed < 5
