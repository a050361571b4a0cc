"""deploy.py through the real pyinfra CLI, in --dry mode against this machine (@local).

--dry gathers the real facts and plans every operation but changes nothing, so this checks that
the deploy loads, validates, gathers its one fact and plans each task, without a host to change.
The full converge runs against the sandbox.
"""

import json
import pwd
import re
import signal
import subprocess
import sys
from pathlib import Path

from local_deploy import FAST_COMMIT, local_inventory, publish

from sparkform.domain.shapes import SHARED_USERS
from sparkform.host import ROOT_PYTHON
from sparkform.rules.inventory import load_inventory
from sparkform.writers import converge
from sparkform.writers.programs import host_source
from sparkform.writers.render import render_host

ROOT = Path(__file__).resolve().parents[2]
PYINFRA = Path(sys.executable).with_name("pyinfra")


def _pyinfra(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([str(PYINFRA), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_deploy_runs_from_any_folder(tmp_path, hub):
    """`cd elsewhere && pyinfra INVENTORY CHECKOUT/deploy.py`: the packaged deploy still imports."""
    publish(hub, tmp_path, "v1")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = _pyinfra(str(local_inventory(tmp_path, endpoint=hub.url)), str(ROOT / "deploy.py"), "--dry", cwd=elsewhere)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Engine slow serving" in result.stdout + result.stderr


def planned_operations(inventory: Path, deploy: str) -> list[str]:
    result = _pyinfra(str(inventory), deploy, "--dry", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    return [op["name"] for op in json.loads(result.stdout)["plan"]]


def test_the_packaged_deploy_run_by_import_path_plans_what_deploy_py_plans(tmp_path, hub):
    """pyinfra's packaged form: sparkform.deploy.converge.converge_host by import path is the deploy file's
    whole plan, each operation under the deploy's name."""
    publish(hub, tmp_path, "v1")
    inventory = local_inventory(tmp_path, endpoint=hub.url)
    by_file = planned_operations(inventory, "deploy.py")
    assert "sparkform | Engine slow serving" in by_file and all(n.startswith("sparkform | ") for n in by_file)
    assert planned_operations(inventory, "sparkform.deploy.converge.converge_host") == by_file
    assert not (tmp_path / "lib").exists(), "--dry changed the host"


def test_dry_run_plans_every_task_and_changes_nothing(tmp_path, hub):
    commit = publish(hub, tmp_path, "v1")
    result = _pyinfra(str(local_inventory(tmp_path, endpoint=hub.url)), "deploy.py", "--dry")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout + result.stderr
    for operation in (
        "Folder " + str(tmp_path / "lib"),
        "vLLM venv vllm==0.27.1",
        f"Checkpoint of fast: org/fast {FAST_COMMIT} -> {FAST_COMMIT}",
        f"Checkpoint of slow: org/slow main -> {commit}",
        "File " + str(tmp_path / "lib/sparkform-launch"),
        "File /etc/systemd/system/vllm-slow.service",
        "Reload systemd units",
        "Engine fast serving",
        "Engine slow serving",
    ):
        assert operation in out, operation
    # Started in `after` order, whatever the inventory's order.
    assert out.index("Engine fast serving") < out.index("Engine slow serving")
    assert not (tmp_path / "lib").exists(), "--dry changed the host"


def test_a_moved_branch_changes_nothing_while_the_host_records_its_pin(tmp_path, hub):
    first = publish(hub, tmp_path, "v1")
    pins = tmp_path / "models" / ".pins"
    pins.mkdir(parents=True)
    (pins / "org--slow@main").write_text(first + "\n")  # what the first converge recorded
    moved = publish(hub, tmp_path, "v2")
    result = _pyinfra(str(local_inventory(tmp_path, endpoint=hub.url)), "deploy.py", "--dry")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout + result.stderr
    assert f"Checkpoint of slow: org/slow main -> {first}" in out
    assert moved not in out
    assert not any(r["path"].startswith("/api/models/org/slow") for r in hub.requests), (
        "a recorded pin must not need the hub"
    )


def test_a_link_planted_at_a_managed_folder_stops_deploy_before_any_change(tmp_path, hub):
    """An engine user who could make models_dir a link would get root's chmod, chown and
    checkpoint writes wherever it points: the deploy names it and exits 3 first (a real run too:
    the check is the plan's, not --dry's)."""
    publish(hub, tmp_path, "v1")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / "models").symlink_to(elsewhere)
    result = _pyinfra(str(local_inventory(tmp_path, endpoint=hub.url)), "deploy.py", "--dry")
    assert result.returncode == 3, result.stdout + result.stderr
    assert f"{tmp_path / 'models'} is a symbolic link" in result.stderr, result.stderr
    assert "nothing was changed" in result.stderr
    assert list(elsewhere.iterdir()) == [] and oct(elsewhere.stat().st_mode & 0o777) == "0o700"


def test_an_account_sparkform_did_not_make_is_refused_as_the_engine_user(tmp_path, hub):
    """Validation refuses the well-known shared accounts by name; any other account of the host
    (here one of this machine's, with a home of its own) shows only in the snapshot: exit 2 naming
    it, before its home is moved."""
    account = next(
        user
        for user in pwd.getpwall()
        if user.pw_name not in SHARED_USERS and re.fullmatch(r"[a-z_][a-z0-9_-]*", user.pw_name)
    )
    publish(hub, tmp_path, "v1")
    inventory = local_inventory(tmp_path, endpoint=hub.url)
    inventory.write_text(
        inventory.read_text().replace('"@local": {', f'"@local": {{"engine_user": "{account.pw_name}",')
    )
    result = _pyinfra(str(inventory), "deploy.py", "--dry")
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"engine_user = '{account.pw_name}': an account of this host that sparkform did not make" in result.stderr
    assert f"(its home is {account.pw_dir})" in result.stderr
    assert pwd.getpwnam(account.pw_name).pw_dir == account.pw_dir


def test_unresolvable_branch_stops_naming_engine_revision_and_fix(tmp_path):
    result = _pyinfra(str(local_inventory(tmp_path)), "deploy.py", "--dry")  # nothing listens on :9
    assert result.returncode == 2
    assert "@local: engine slow: checkpoint.revision = 'main': cannot resolve org/slow@main" in result.stderr, (
        result.stderr
    )
    assert "pin a 40-hex commit id" in result.stderr
    assert "engine fast" not in result.stderr  # a commit id needs no hub
    assert not (tmp_path / "lib").exists()


def test_broken_inventory_stops_before_connecting(tmp_path):
    result = _pyinfra(str(local_inventory(tmp_path, ', "max_num_seq": 64')), "deploy.py", "--dry")
    assert result.returncode == 2
    assert "engine fast: max_num_seq = 64: unknown key" in result.stderr
    assert "Connecting to hosts" not in result.stdout + result.stderr


def test_dry_run_copies_the_wheelhouse_only_when_a_venv_is_built(tmp_path):
    source = tmp_path / "wheels"
    source.mkdir()
    (source / "demo-1.0-py3-none-any.whl").write_bytes(b"not a real wheel")
    inventory = tmp_path / "wh.py"
    inventory.write_text(f"""
from sparkform.inventory import hosts
local = hosts({{"@local": {{
    "lib_dir": "{tmp_path}/lib", "config_dir": "{tmp_path}/etc", "state_dir": "{tmp_path}/state",
    "venv_root": "{tmp_path}/venvs", "models_dir": "{tmp_path}/models", "cache_root": "{tmp_path}/cache",
    "wheelhouse": "{tmp_path}/wh", "wheelhouse_source": "{source}",
    "engines": [{{"name": "x", "port": 18000, "checkpoint": {{"repo": "o/x", "revision": "{FAST_COMMIT}"}}}}],
}}}}, __file__)
""")
    result = _pyinfra(str(inventory), "deploy.py", "--dry")
    assert result.returncode == 0, result.stdout + result.stderr
    plan_line = next(line for line in (result.stdout + result.stderr).splitlines() if "Wheelhouse on the host" in line)
    assert "1 (@local)" in plan_line
    assert not (tmp_path / "wh").exists()


def test_dry_run_names_a_rolled_back_change_the_inventory_still_renders(tmp_path, hub):
    """The host holds a rollback record of the very settings this inventory renders for fast:
    the run says so first (and plans to keep what each engine serves once it serves)."""
    publish(hub, tmp_path, "v1")
    inventory = local_inventory(tmp_path, endpoint=hub.url)
    (local,) = load_inventory(inventory)
    (fast,) = [e for e in local.config.engines if e.name == "fast"]
    failed = converge.engine_settings_digest(local.config, fast, render_host(local.config))
    kept = Path(local.config.paths.kept("fast"))
    kept.mkdir(parents=True)
    reason = "ValueError: unrecognized arguments: --bogus"
    record = {"engine": "fast", "at": 1764572000, "by": "deploy", "reason": reason, "failed": failed}
    (kept / "rolled-back.json").write_text(json.dumps(record) + "\n")
    result = _pyinfra(str(inventory), "deploy.py", "--dry")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout + result.stderr
    assert f"fast runs its previous settings since 2025-12-01 06:53 UTC: {reason}" in out
    assert "slow runs its previous" not in out
    assert "Settings fast serves kept" in out and "Settings slow serves kept" in out


def held_host(tmp_path: Path, wait_s: int, hub) -> tuple[Path, subprocess.Popen]:
    """A local inventory that waits `wait_s` for the host lock, and a holder that holds it (the
    module's `hold`, as another deploy would, named "the other deploy by owner@laptop")."""
    publish(hub, tmp_path, "v1")
    inventory = local_inventory(tmp_path, endpoint=hub.url)
    inventory.write_text(inventory.read_text().replace('"hf_endpoint"', f'"host_lock_wait_s": {wait_s}, "hf_endpoint"'))
    lock = load_inventory(inventory)[0].config.paths.host_lock
    holder = subprocess.Popen(
        [*ROOT_PYTHON, "-c", host_source("hostlock"), "hold", "0", lock, "the other deploy by owner@laptop"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline() == "locked\n"
    return inventory, holder


def test_a_deploy_while_another_holds_the_host_names_it_waits_and_exits_4(tmp_path, hub):
    inventory, holder = held_host(tmp_path, 2, hub)
    try:
        result = _pyinfra(str(inventory), "deploy.py", "--dry")
    finally:
        holder.stdin.close()
        holder.wait(10)
    out = result.stdout + result.stderr
    assert result.returncode == 4, out
    assert re.search(r"another run holds this host: the other deploy by owner@laptop since 20\S+ \S+ UTC; waiting", out)
    assert "another run held this host for the whole wait (host_lock_wait_s, 2 s)" in out, out
    assert "Engine slow serving" not in out  # nothing was read or planned
    # The holder gone, the same run takes the host at once.
    assert _pyinfra(str(inventory), "deploy.py", "--dry").returncode == 0


def test_a_deploy_cut_by_ctrl_c_exits_130(tmp_path, hub):
    """pyinfra's own handler exits 0 ("Exiting upon user request!"); a cut run must not look done.
    Cut while it waits for the host (a moment every run passes through)."""
    inventory, holder = held_host(tmp_path, 60, hub)
    try:
        run = subprocess.Popen(
            [str(PYINFRA), str(inventory), "deploy.py", "--dry"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for line in run.stdout:
            if "another run holds this host" in line:
                break
        run.send_signal(signal.SIGINT)
        out = run.communicate(timeout=30)[0]
    finally:
        holder.stdin.close()
        holder.wait(10)
    assert run.returncode == 130, out
    assert "the run was cut (Ctrl-C) before its last operation: exit 130" in out
