"""`pip install .` gives a working sparkform: the wheel pip builds from this checkout carries the
deploy (sparkform.deploy and the file pyinfra runs), its templates, the locks, the shipped
inventories and the verify suite as package data, installs nothing beside the package, and the CLI
and the deploy work from it, run from another folder.

The wheel is built for real by pip (setuptools in an isolated build environment, from the
package index) from a copy of the checkout, so the checkout gets no build/ folder. The install
into a fresh venv against the sandbox is tests/integration/test_install.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from checkout_copy import copy_checkout
from local_deploy import local_inventory, publish
from samples import SERVED_PAIR

REPO = Path(__file__).resolve().parents[2]
SEED_INVENTORY = SERVED_PAIR
# The package data the wheel carries, as the checkout lays it out (templates/ and the shipped
# inventories at the top, reached from the package through its links).
PACKAGE_DATA = {"templates": "templates", "locks": "sparkform/locks", "verify": "sparkform/verify"}
SHIPPED_INVENTORIES = ("spark.py", "sandbox.py", "sandbox-pair.py", "model_configs")


def checkout_files(name: str) -> set[str]:
    path = REPO / name
    if path.is_file():
        return {name}
    return {
        str(p.relative_to(REPO))
        for p in path.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `pip install .` builds from this checkout."""
    folder = tmp_path_factory.mktemp("wheel")
    copy_checkout(folder / "src")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(folder / "dist"), str(folder / "src")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (built,) = (folder / "dist").glob("sparkform-*.whl")
    return built


@pytest.fixture(scope="module")
def unpacked(wheel, tmp_path_factory) -> Path:
    """The wheel as pip installs it: its files in a site folder."""
    site = tmp_path_factory.mktemp("site")
    zipfile.ZipFile(wheel).extractall(site)
    return site


def test_the_wheel_carries_deploy_and_data_and_nothing_outside_the_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert top_level == {"sparkform", wheel.name.split("-py3")[0] + ".dist-info"}
    for folder, source in PACKAGE_DATA.items():
        prefix = f"sparkform/{folder}/"
        carried = {name.removeprefix(prefix) for name in names if name.startswith(prefix)}
        assert carried == {name.removeprefix(f"{source}/") for name in checkout_files(source)}, folder
    prefix = "sparkform/inventories/"
    inventories = {name.removeprefix(prefix) for name in names if name.startswith(prefix)}
    expected = set().union(*(checkout_files(f"inventory/{name}") for name in SHIPPED_INVENTORIES))
    assert inventories == {name.removeprefix("inventory/") for name in expected}
    for needed in (
        "sparkform/deploy/deploy.py",
        "sparkform/deploy/operations/venv.py",
        "sparkform/deploy/facts/snapshot.py",
        "sparkform/templates/engine.service.j2",
        "sparkform/locks/vllm-0.27.1-cuda-aarch64.txt",
        "sparkform/verify/conftest.py",
        "sparkform/verify/pytest.ini",
        "sparkform/sandbox/nvidia-smi",
    ):
        assert needed in names
    assert not [name for name in names if "__pycache__" in name or name.endswith(".pyc")]


def run_from_wheel(site: Path, *command: str, cwd: Path) -> subprocess.CompletedProcess:
    """`command` with the wheel's sparkform first on the path (its dependencies from this venv)."""
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=env, timeout=120)


def test_render_and_deploy_path_work_from_the_wheel_in_another_folder(unpacked, tmp_path):
    """TemplateNotFound before the wheel carried the templates."""
    sparkform = (sys.executable, "-c", "import sys; from sparkform.cli import main; sys.exit(main())")
    located = run_from_wheel(unpacked, *sparkform, "deploy-path", cwd=tmp_path)
    assert located.returncode == 0, located.stderr
    assert Path(located.stdout.strip()) == unpacked / "sparkform" / "deploy" / "deploy.py"
    out = tmp_path / "rendered"
    rendered = run_from_wheel(
        unpacked, *sparkform, "render", str(SEED_INVENTORY), "--out", str(out), "--offline", cwd=tmp_path
    )
    assert rendered.returncode == 0, rendered.stderr
    assert "Restart=always" in (out / "spark.local/etc/systemd/system/vllm-q38.service").read_text()
    # The lock the Spark's venv installs from is the wheel's copy.
    plan = run_from_wheel(unpacked, *sparkform, "plan", "--json", str(SEED_INVENTORY), cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    where = run_from_wheel(
        unpacked, sys.executable, "-c", "import sparkform.domain.locks as l; print(l.LOCKS)", cwd=tmp_path
    )
    assert Path(where.stdout.strip()) == unpacked / "sparkform" / "locks"


def test_the_wheels_deploy_plans_a_dry_run_from_another_folder(unpacked, tmp_path, hub):
    publish(hub, tmp_path, "v1")
    deploy = unpacked / "sparkform" / "deploy" / "deploy.py"
    pyinfra = Path(sys.executable).with_name("pyinfra")
    result = run_from_wheel(
        unpacked, str(pyinfra), str(local_inventory(tmp_path, endpoint=hub.url)), str(deploy), "--dry", cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Engine slow serving" in result.stdout + result.stderr
