"""The real deploy on the sandbox: converge from scratch, verify, stay idempotent, show diffs
without changing anything, restart only what changed, and come back in order after a reboot.

One sandbox for the module; the tests run in file order and each leaves the host converged.
Everything is read from systemd, the journal and the endpoints, not from the toolkit's output.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from sparkform.sandbox import host, stage

ROOT = Path(__file__).resolve().parents[2]
SANDBOX_INVENTORY = ROOT / "inventory" / "sandbox.py"
BIN = Path(sys.executable).parent
BOOT_BACK_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def box():
    name = f"c-{uuid.uuid4().hex[:6]}"
    os.environ["SPARKFORM_SANDBOX"] = name
    sandbox = stage.up(name)
    try:
        yield sandbox
    finally:
        stage.down(name)
        os.environ.pop("SPARKFORM_SANDBOX", None)


def pyinfra(inventory: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "pyinfra"), str(inventory), "deploy.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)


def ssh(box: host.Sandbox, command: str) -> str:
    return subprocess.run([*box.ssh_args(), command], capture_output=True, text=True, check=True,
                          timeout=120).stdout


def main_pids(box: host.Sandbox) -> dict[str, int]:
    out = ssh(box, "systemctl show -p Id,MainPID vllm-nemotron.service vllm-q38.service")
    ids = re.findall(r"Id=(\S+)", out)
    pids = [int(pid) for pid in re.findall(r"MainPID=(\d+)", out)]
    return dict(zip(ids, pids))


def changed_operations(inventory: Path) -> list[str]:
    """Names of the operations a --dry run would change (pyinfra has no 'changes pending' code)."""
    result = pyinfra(inventory, "--dry", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)["plan"]
    return [op["name"] for op in plan if op["hosts_with_change"]]


def edited_inventory(tmp_path: Path, q38_changes: dict) -> Path:
    """The sandbox inventory with q38's fields changed, as a user would edit it."""
    path = tmp_path / "edited.py"
    path.write_text(
        "import runpy\n"
        "from sparkform.inventory import hosts\n"
        f"data = runpy.run_path({str(SANDBOX_INVENTORY)!r})['sandbox'][0][1]\n"
        "q38 = next(e for e in data['engines'] if e['name'] == 'q38')\n"
        f"q38.update({q38_changes!r})\n"
        f"edited = hosts({{{os.environ['SPARKFORM_SANDBOX']!r}: data}}, __file__)\n")
    return path


def test_converge_from_scratch_then_verify(box):
    started = time.monotonic()
    result = pyinfra(SANDBOX_INVENTORY, "-y")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    print(f"\nconverge from scratch: {time.monotonic() - started:.0f} s")
    verify = subprocess.run([str(BIN / "sparkform"), "verify", str(SANDBOX_INVENTORY)],
                            capture_output=True, text=True, timeout=600)
    assert verify.returncode == 0, verify.stdout[-4000:]


def test_second_run_changes_nothing(box):
    before = main_pids(box)
    assert changed_operations(SANDBOX_INVENTORY) == []
    result = pyinfra(SANDBOX_INVENTORY, "-y")
    assert result.returncode == 0, result.stderr[-4000:]
    assert main_pids(box) == before


def test_dry_diff_shows_only_the_edited_file_and_changes_nothing(box, tmp_path):
    inventory = edited_inventory(tmp_path, {"max_num_seqs": 2})
    args_file = "/etc/sparkform/engines/q38.args"
    before = ssh(box, f"sha256sum {args_file} /etc/sparkform/engines/* /etc/systemd/system/vllm-*")
    result = pyinfra(inventory, "--dry", "--diff")
    assert result.returncode == 0, result.stderr[-4000:]
    out = result.stdout + result.stderr
    modified = re.findall(r"Will (?:modify|create) (\S+)", re.sub(r"\x1b\[[0-9;]*m", "", out))
    assert modified == [args_file]
    diff = re.sub(r"\x1b\[[0-9;]*m", "", out)
    assert re.search(r"^\s*-\s*4$", diff, re.M) and re.search(r"^\s*\+\s*2$", diff, re.M), diff[-3000:]
    assert changed_operations(inventory) == [f"File {args_file}", "Engine q38 serving"]
    assert ssh(box, f"sha256sum {args_file} /etc/sparkform/engines/* /etc/systemd/system/vllm-*") == before


def test_edit_restarts_only_that_engine(box, tmp_path):
    before = main_pids(box)
    result = pyinfra(edited_inventory(tmp_path, {"max_num_seqs": 2}), "-y")
    assert result.returncode == 0, result.stderr[-4000:]
    after = main_pids(box)
    assert after["vllm-nemotron.service"] == before["vllm-nemotron.service"]
    assert after["vllm-q38.service"] not in (0, before["vllm-q38.service"])
    cmdline = ssh(box, f"tr '\\0' ' ' < /proc/{after['vllm-q38.service']}/cmdline")
    assert "--max-num-seqs 2 " in cmdline
    # Back to the inventory as checked in: again only q38 moves.
    assert pyinfra(SANDBOX_INVENTORY, "-y").returncode == 0
    assert main_pids(box)["vllm-nemotron.service"] == before["vllm-nemotron.service"]


def test_broken_inventory_fails_before_connecting(box, tmp_path):
    result = pyinfra(edited_inventory(tmp_path, {"after": ["nemotorn"]}), "-y")
    assert result.returncode == 2
    assert "engine q38: after = 'nemotorn': no engine of that name" in result.stderr
    assert "Connecting" not in result.stdout + result.stderr


def _journal_times(box: host.Sandbox, pattern: str) -> list[float]:
    lines = ssh(box, "journalctl -b -u vllm-nemotron -u vllm-q38 --no-pager -o short-unix").splitlines()
    return [float(line.split()[0]) for line in lines if re.search(pattern, line)]


def test_reboot_brings_both_back_second_after_first_is_ready(box):
    host.reboot(box.name)
    deadline = time.monotonic() + BOOT_BACK_TIMEOUT_S
    while time.monotonic() < deadline:
        states = ssh(box, "systemctl is-active vllm-nemotron vllm-q38 || true").split()
        if states == ["active", "active"]:
            break
        assert "failed" not in states, ssh(box, "journalctl -b -u vllm-q38 -u vllm-nemotron -n 60 --no-pager")
        time.sleep(2)
    else:
        pytest.fail(f"engines not both active {BOOT_BACK_TIMEOUT_S} s after the reboot: {states}")
    (nemotron_ready,) = _journal_times(box, r"sparkform-wait-ready: port 8012 serves")
    (q38_start,) = _journal_times(box, r"sparkform-launch: starting q38")
    assert q38_start > nemotron_ready, "q38 started before nemotron was ready"
    print(f"\nafter the reboot q38 started {q38_start - nemotron_ready:.1f} s after nemotron was ready")
    verify = subprocess.run([str(BIN / "sparkform"), "verify", str(SANDBOX_INVENTORY)],
                            capture_output=True, text=True, timeout=600)
    assert verify.returncode == 0, verify.stdout[-4000:]
