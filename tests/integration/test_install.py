"""`pip install <checkout>` (not editable) into a fresh venv gives a working tool: from another
folder, `sparkform render` writes exactly the files the deploy put on the converged sandbox (the
commits the host pinned, asked over SSH), `sparkform verify` runs its suite, and pyinfra runs the
checkout's deploy.py and the wheel's own (`sparkform deploy-path`) as dry runs that change nothing.

The venv's dependencies come from the package index, as a user's would.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from checkout_copy import copy_checkout
from deploy_helpers import ROOT, SANDBOX_INVENTORY, edited_inventory, ssh

pytestmark = pytest.mark.usefixtures("converged")
SHARES_SANDBOX = True  # it only reads the converged host
CI_MINUTES = 2  # wall time in CI, its sandbox setups included (the table at the end of `make test`)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The bin folder of a fresh venv with `pip install <a copy of the checkout>`."""
    folder = tmp_path_factory.mktemp("install")
    copy_checkout(folder / "checkout")
    subprocess.run([sys.executable, "-m", "venv", str(folder / "venv")], check=True, timeout=120)
    bin_dir = folder / "venv" / "bin"
    result = subprocess.run(
        [str(bin_dir / "pip"), "install", "--quiet", "--disable-pip-version-check", str(folder / "checkout")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return bin_dir


def run(bin_dir: Path, *command: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(bin_dir / command[0]), *command[1:]], capture_output=True, text=True, cwd=cwd, timeout=900
    )


def test_the_installed_wheel_holds_the_deploy_inside_the_package(installed):
    site = next((installed.parent / "lib").glob("python3*/site-packages"))
    assert not (site / "tasks").exists() and not (site / "facts").exists()
    assert (site / "sparkform" / "deploy" / "deploy.py").is_file()
    assert (site / "sparkform" / "templates" / "engine.service.j2").is_file()


def test_render_writes_what_the_deploy_put_on_the_host(installed, box, tmp_path):
    out = tmp_path / "rendered"
    result = run(installed, "sparkform", "render", str(SANDBOX_INVENTORY), "--out", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # every branch got the commit the host pinned
    root = out / box.name
    rendered = {"/" + str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    assert len(rendered) > 10
    on_host = ssh(box, "sha256sum " + " ".join(shlex.quote(path) for path in rendered)).stdout
    assert {line.split()[1]: line.split()[0] for line in on_host.splitlines()} == {
        path: hashlib.sha256(content).hexdigest() for path, content in rendered.items()
    }


def test_render_of_a_branch_the_host_never_pinned_says_so_in_one_line(installed, box, tmp_path):
    moved = {"q38": {"checkpoint": {"repo": "sparkform-test/tiny-llama", "revision": "never-deployed"}}}
    inventory = edited_inventory(tmp_path, engine_changes=moved)
    out = tmp_path / "rendered"
    result = run(installed, "sparkform", "render", str(inventory), "--out", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        f"sparkform render: {box.name}: the host records no commit for sparkform-test/tiny-llama@never-deployed "
        "(not deployed yet); wrote the revision as named (sparkform-test/tiny-llama@never-deployed) where a "
        "deploy writes the commit it pins"
    ]
    settings = out / box.name / "etc/sparkform/engines"
    assert "tiny-llama@never-deployed" in (settings / "q38.env").read_text()
    nemotron = (settings / "nemotron.env").read_text()
    assert "tiny-qwen3@main" not in nemotron and ssh(box, "cat /etc/sparkform/engines/nemotron.env").stdout == nemotron


def test_verify_runs_its_suite_from_the_installed_wheel(installed, tmp_path):
    result = run(installed, "sparkform", "verify", str(SANDBOX_INVENTORY), cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout


@pytest.mark.parametrize("deploy", ["checkout", "wheel"])
def test_a_dry_run_from_another_folder_changes_nothing(installed, deploy, tmp_path):
    if deploy == "checkout":
        path = str(ROOT / "deploy.py")
    else:
        path = run(installed, "sparkform", "deploy-path", cwd=tmp_path).stdout.strip()
        assert "site-packages/sparkform/deploy/deploy.py" in path
    result = run(installed, "pyinfra", str(SANDBOX_INVENTORY), path, "--dry", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    plan = json.loads(result.stdout)["plan"]
    assert [op["name"] for op in plan if op["hosts_with_change"]] == []


def test_init_then_plan_in_an_empty_folder_before_any_secret_or_host_key(installed, tmp_path):
    """The installed wheel's own template: the plan of the written inventory exits 0 and lists what
    a deploy still needs (the key, the pinned host key); SPARKFORM_INVENTORY names it the same."""
    home = tmp_path / "home"  # no ~/.config/sparkform yet
    env = {**os.environ, "HOME": str(home)}
    env.pop("SPARKFORM_INVENTORY", None)
    written = subprocess.run(
        [str(installed / "sparkform"), "init", "my-spark.py", "--host", "spark.example"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120,
    )  # fmt: skip
    assert written.returncode == 0 and "sparkform plan my-spark.py" in written.stdout, written.stderr
    plans = [
        subprocess.run([str(installed / "sparkform"), "plan", *named], capture_output=True, text=True, cwd=tmp_path,
                       env=env | extra, timeout=120)
        for named, extra in ((["my-spark.py"], {}), ([], {"SPARKFORM_INVENTORY": "my-spark.py"}))
    ]  # fmt: skip
    for plan in plans:
        assert plan.returncode == 0, plan.stderr
        assert "nemotron" in plan.stdout and "What a deploy still needs" in plan.stdout
        assert "ssh_known_hosts_file" in plan.stdout and "api_key_file" in plan.stdout
    assert plans[0].stdout == plans[1].stdout
