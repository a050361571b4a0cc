"""The sandbox's parts that run without booting anything: the link's addresses, a Sandbox loaded
from a runtime folder, the supervisor script, and `sparkform sandbox`'s command line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from sparkform import cli
from sparkform.sandbox import machine, network, nspawn, registry, stage


@pytest.fixture
def runtime_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty RUNTIME_ROOT in tmp_path."""
    monkeypatch.setattr(registry, "RUNTIME_ROOT", tmp_path)
    return tmp_path


def fake_up(root: Path, name: str, index: int) -> Path:
    """The runtime folder of a machine `up` left behind (index and ssh_config only)."""
    folder = root / name
    folder.mkdir()
    (folder / "index").write_text(f"{index}\n")
    (folder / "ssh_config").write_text("")
    return folder


def test_addresses_of_a_link() -> None:
    assert network.addresses(7) == ("10.233.7.1", "10.233.7.2")
    assert network.netns_name("box") == "sfsb-box"


def test_a_sandbox_loaded_from_its_runtime_folder(runtime_root: Path) -> None:
    folder = fake_up(runtime_root, "box", 12)
    box = machine.get("box")
    assert (box.address, box.host_address, box.runtime_dir) == ("10.233.12.2", "10.233.12.1", folder)
    assert box.ssh_args() == ["ssh", "-F", str(folder / "ssh_config"), "sfsb-box"]
    assert registry.names() == ["box"]
    assert registry.free_index() == 1


def test_the_supervisor_script_is_clean_sh() -> None:
    subprocess.run(["sh", "-n", "-c", nspawn.SUPERVISOR_SH], check=True)
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (make system-deps installs it)")
    result = subprocess.run(
        ["shellcheck", "-s", "sh", "-"], input=nspawn.SUPERVISOR_SH, check=False, capture_output=True, text=True
    )
    assert (result.returncode, result.stdout) == (0, "")


@pytest.fixture
def ups(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, list]]:
    """Calls of machine.up and stage.up, as (which, name, binds), answered with a stand-in box."""
    calls: list[tuple[str, str, list]] = []

    def recorder(which: str):
        def up(name: str, binds: list) -> SimpleNamespace:
            calls.append((which, name, list(binds)))
            return SimpleNamespace(ssh_config=Path("/x/ssh_config"), host_alias=f"sfsb-{name}")

        return up

    monkeypatch.setattr(machine, "up", recorder("bare"))
    monkeypatch.setattr(stage, "up", recorder("staged"))
    return calls


def test_sandbox_up_with_name_before_or_after_the_action(ups, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["sandbox", "up"]) == 0
    assert cli.main(["sandbox", "--name", "a", "up"]) == 0
    assert cli.main(["sandbox", "--name", "a", "up", "--name", "b", "--bare", "--bind-ro", "/h:/g"]) == 0
    assert [call[:2] for call in ups] == [("staged", "sandbox"), ("staged", "a"), ("bare", "b")]
    assert ups[-1][2] == [("/h", "/g")]
    assert capsys.readouterr().out.splitlines()[-1] == "ssh: ssh -F /x/ssh_config sfsb-b"


def test_sandbox_up_keep_leaves_a_machine_that_is_up_as_it_is(
    ups, runtime_root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`make sandbox` a second time: the running machine is kept, then converged and verified."""
    fake_up(runtime_root, "kept", 3)
    monkeypatch.setattr(machine, "status", lambda name: {"up": name == "kept"})
    assert cli.main(["sandbox", "up", "--keep", "--name", "kept"]) == 0
    assert cli.main(["sandbox", "up", "--keep", "--name", "fresh"]) == 0
    assert [call[:2] for call in ups] == [("staged", "fresh")]
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["kept is already up: kept as it is", f"ssh: ssh -F {runtime_root}/kept/ssh_config sfsb-kept"]


def test_sandbox_bind_without_a_colon_is_refused(ups) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["sandbox", "up", "--bare", "--bind-ro", "/only-a-host-path"])
    assert exit_.value.code == 2 and ups == []


def test_sandbox_names_and_status_of_a_name_that_is_not_up(
    runtime_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_up(runtime_root, "one", 1)
    fake_up(runtime_root, "two", 2)
    assert cli.main(["sandbox", "names"]) == 0
    assert capsys.readouterr().out.split() == ["one", "two"]
    assert cli.main(["sandbox", "status", "--name", "three"]) == 0
    assert capsys.readouterr().out == "three: not up\n"
    assert cli.main(["sandbox", "status", "--name", "three", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["up"] is False  # nothing but the JSON object


def test_sandbox_errors_name_the_action(runtime_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["sandbox", "--name", "Not_A_Name", "reboot"]) == 1
    assert capsys.readouterr().err.startswith("sparkform sandbox reboot: bad sandbox name 'Not_A_Name'")


def test_without_the_sandbox_extra_the_sandbox_says_what_to_install(
    ups, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A laptop install without `sparkform[sandbox]`: one line naming the packages, nothing booted;
    a bare machine needs none of them."""
    monkeypatch.setitem(sys.modules, "numpy", None)  # as if it were not installed
    assert cli.main(["sandbox", "up"]) == 1
    assert capsys.readouterr().err == "sparkform sandbox: numpy missing: pip install 'sparkform[sandbox]'\n"
    assert cli.main(["sandbox", "up", "--bare"]) == 0
    assert [call[0] for call in ups] == ["bare"]
