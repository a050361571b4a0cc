"""What the deploy tests on the sandbox share: running pyinfra and sparkform for real, reading
the host over SSH, and inventories edited the way a user edits one."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from sparkform.domain import layout
from sparkform.domain.schema import HostConfig
from sparkform.sandbox import machine, stage
from sparkform.sandbox.alerts import read_alerts

ROOT = Path(__file__).resolve().parents[2]
# The pair every module converges; the shipped inventory is the whole box (the pair and an embedding engine).
SANDBOX_INVENTORY = ROOT / "tests" / "integration" / "sandbox_pair.py"
WHOLE_BOX_INVENTORY = ROOT / "inventory" / "sandbox.py"
BIN = Path(sys.executable).parent
UNITS = (layout.engine_unit("nemotron"), layout.engine_unit("q38"))
# The sandbox inventory keeps the default folders; where sparkform puts its files in them.
DEFAULT_FOLDERS = {
    name: HostConfig.model_fields[name].default
    for name in ("lib_dir", "config_dir", "state_dir", "models_dir", "venv_root", "socket_dir")
}
PATHS = layout.HostPaths(DEFAULT_FOLDERS["lib_dir"], DEFAULT_FOLDERS["config_dir"], DEFAULT_FOLDERS["state_dir"])


def engine_socket(engine: str) -> str:
    """The unix socket engine `engine` serves on in the sandbox (its API has no TCP port)."""
    return layout.engine_socket(DEFAULT_FOLDERS["socket_dir"], engine)


def engine_url(engine: str, path: str) -> str:
    """curl's arguments that reach `path` of the engine itself, on the box (as root)."""
    return layout.engine_curl(engine_socket(engine), path)


def long_generations(engine: str, count: int) -> str:
    """A shell script that keeps `count` completions of 1,800 tokens (no early stop) running on
    `engine` until it is stopped: every sequence slot busy, and a queue past them."""
    body = json.dumps({"model": engine, "prompt": "tell me", "max_tokens": 1800, "ignore_eos": True})
    return (
        f"for slot in $(seq {count}); do ( while true; do curl -s -o /dev/null --max-time 600 "
        f"-H 'Content-Type: application/json' -d '{body}' {engine_url(engine, '/v1/completions')}; done ) & done; wait"
    )


CONVERGED: set[str] = set()  # sandboxes a deploy of SANDBOX_INVENTORY converged in this session


def mark_converged(box: machine.Sandbox) -> None:
    """A test's own deploy converged the sandbox: the `converged` fixture need not deploy again."""
    CONVERGED.add(box.name)


def pyinfra(inventory: Path, *args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "pyinfra"), str(inventory), "deploy.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def verify(*options: str, inventory: Path = SANDBOX_INVENTORY) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "sparkform"), "verify", str(inventory), *options], capture_output=True, text=True, timeout=600
    )


def sparkform(command: str, *options: str, inventory: Path = SANDBOX_INVENTORY) -> subprocess.CompletedProcess:
    """`sparkform COMMAND INVENTORY OPTIONS...`, as a user runs it."""
    return subprocess.run(
        [str(BIN / "sparkform"), command, str(inventory), *options], capture_output=True, text=True, timeout=300
    )


def status(*options: str, inventory: Path = SANDBOX_INVENTORY) -> subprocess.CompletedProcess:
    return sparkform("status", *options, inventory=inventory)


def ssh(
    box: machine.Sandbox, command: str, check: bool = True, stdin: str | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*box.ssh_args(), command], capture_output=True, text=True, check=check, timeout=300, input=stdin
    )


def unit_properties(box: machine.Sandbox, unit: str, *names: str) -> dict[str, str]:
    out = ssh(box, f"systemctl show -p {','.join(names)} {unit}").stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def main_pids(box: machine.Sandbox) -> dict[str, int]:
    return {unit: int(unit_properties(box, unit, "MainPID")["MainPID"]) for unit in UNITS}


def engine_core(box: machine.Sandbox, unit: str) -> int:
    """The pid of the EngineCore child of `unit`'s API server."""
    pid = unit_properties(box, unit, "MainPID")["MainPID"]
    core = ssh(box, f"ps -o pid=,args= --ppid {pid} | awk '/EngineCore/ {{print $1; exit}}'").stdout.strip()
    assert core, f"no EngineCore child of {unit}'s API server {pid}"
    return int(core)


def alerts(box: machine.Sandbox) -> list[dict]:
    """What the sandbox's alert receiver got, oldest first."""
    return [entry["alert"] for entry in read_alerts(stage.alerts_file(box.runtime_dir))]


def watchdog_verdict_s(config: HostConfig) -> float:
    """The most the guard's watchdog takes to judge a silent engine of `config`: K failed probes,
    rounds an interval apart but one at a time, and two /metrics reads (after the first and the last
    failure), each probe and read at most a deadline; up to one interval before the first probe."""
    k, interval, deadline = config.watchdog_failures, config.watchdog_interval_s, config.watchdog_deadline_s
    return max((k - 1) * interval + deadline, (k + 1) * deadline) + deadline + interval


def hang_detected_s(config: HostConfig) -> float:
    """The most a hung engine of `config` waits for the watchdog's alert: its verdict, and 20 s of
    slack for a busy CI."""
    return watchdog_verdict_s(config) + 20


def why_it_restarted(box: machine.Sandbox, unit: str) -> str:
    """What the host says about `unit`'s restarts this boot: the end of its journal and the
    guard's last lines (watchdog and memory-guard actions), for an assertion's message."""
    return ssh(
        box,
        f"journalctl -b --no-pager -o short-monotonic -n 15 -u {unit}; "
        "journalctl -b --no-pager -o short-monotonic -n 10 -t sparkform-guard",
        check=False,
    ).stdout


def wait_for(predicate, timeout: float, what: str, poll: float = 1.0):
    """Poll `predicate` until it returns something truthy; fail naming `what` at the timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def both_serving_after_boot(box: machine.Sandbox, timeout: float = 600) -> None:
    """Wait until both engines are active after a reboot; fail at once if one fails."""

    def both_active() -> bool:
        states = ssh(box, f"systemctl is-active {' '.join(UNITS)} || true").stdout.split()
        assert "failed" not in states, ssh(box, "journalctl -b -u vllm-q38 -u vllm-nemotron -n 60 --no-pager").stdout
        return states == ["active", "active"]

    wait_for(both_active, timeout, "both engines active after the reboot", 2)


def serving(box: machine.Sandbox, unit: str) -> bool:
    """Active means ExecStartPost (the readiness helper) reported it serving."""
    return ssh(box, f"systemctl is-active {unit}", check=False).stdout.strip() == "active"


DEPLOY_PREFIX = "sparkform | "  # sparkform.deploy.converge.converge_host


def changed_operations(inventory: Path) -> list[str]:
    """Names of the operations a --dry run would change (pyinfra has no 'changes pending' code),
    without the packaged deploy's name that pyinfra puts before each ("sparkform | ")."""
    result = pyinfra(inventory, "--dry", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)["plan"]
    names = [op["name"] for op in plan if op["hosts_with_change"]]
    assert all(name.startswith(DEPLOY_PREFIX) for name in names), names
    return [name.removeprefix(DEPLOY_PREFIX) for name in names]


def edited_inventory(
    folder: Path,
    engine_changes: dict[str, dict] | None = None,
    host_changes: dict | None = None,
    drop: tuple[str, ...] = (),
    add: tuple[dict, ...] = (),
) -> Path:
    """The sandbox inventory with some fields changed, engines dropped or added, as a user would
    edit it."""
    path = folder / f"edited-{time.monotonic_ns()}.py"
    path.write_text(
        "import runpy\n"
        "from sparkform.rules.inventory import hosts\n"
        f"data = runpy.run_path({str(SANDBOX_INVENTORY)!r})['sandbox'][0][1]\n"
        f"data.update({host_changes or {}!r})\n"
        f"data['engines'] = [e for e in data['engines'] if e['name'] not in {list(drop)!r}] + {list(add)!r}\n"
        f"for engine in data['engines']:\n"
        f"    engine.update({engine_changes or {}!r}.get(engine['name'], {{}}))\n"
        f"edited = hosts({{{os.environ['SPARKFORM_SANDBOX']!r}: data}}, __file__)\n"
    )
    return path


def checkpoint_dir(box: machine.Sandbox, engine: str) -> str:
    """The checkpoint folder the engine's rendered settings point it at (repo@commit)."""
    return ssh(box, f"sed -n 's/^SPARKFORM_CHECKPOINT=//p' {PATHS.engine_settings(engine)[0]}").stdout.strip()


# A byte of the shard's middle flipped, its size and mtime kept: what bit rot looks like to a
# deploy, which trusts both.
_FLIP_A_BYTE = (
    "import os, sys\n"
    "path = sys.argv[1]\n"
    "stat = os.stat(path)\n"
    "with open(path, 'r+b') as handle:\n"
    "    handle.seek(stat.st_size // 2)\n"
    "    byte = handle.read(1)[0]\n"
    "    handle.seek(stat.st_size // 2)\n"
    "    handle.write(bytes([byte ^ 0xFF]))\n"
    "os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))\n"
)


def flip_a_byte_keeping_size_and_mtime(box: machine.Sandbox, path: str) -> None:
    ssh(box, f"python3 -c {shlex.quote(_FLIP_A_BYTE)} {shlex.quote(path)}")


def journal_times(
    box: machine.Sandbox, pattern: str, units: tuple[str, ...] = UNITS, since: str | None = None
) -> list[float]:
    """Unix times of this boot's journal lines of `units` that match `pattern` (from `since`, a
    unix time, when given)."""
    selectors = " ".join(f"-u {unit}" for unit in units) + (f" --since @{since}" if since else "")
    lines = ssh(box, f"journalctl -b {selectors} --no-pager -o short-unix").stdout.splitlines()
    return [float(line.split()[0]) for line in lines if re.search(pattern, line)]
