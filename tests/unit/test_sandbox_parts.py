"""The sandbox's parts that run without booting anything: the link's and the pair cable's addresses,
a Sandbox loaded from a runtime folder, the supervisor script, and `sparkform sandbox`'s command line."""

from __future__ import annotations

import ipaddress
import json
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest
from venv_image import keep_only

from sparkform import cli
from sparkform.sandbox import machine, network, nspawn, registry, stage
from sparkform.sandbox.system import SandboxError


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


def test_the_cable_s_addresses_and_interface() -> None:
    assert network.cable_addresses(7) == ("10.234.7.1", "10.234.7.2")
    links = ipaddress.ip_network("10.233.0.0/16")
    for index in range(1, registry.MAX_INDEX + 1):
        here, there = (ipaddress.ip_address(address) for address in network.cable_addresses(index))
        cable = ipaddress.ip_network(f"{here}/{network.LINK_PREFIX_LENGTH}", strict=False)
        # Both ends on one /30 of the cable range, its usable pair, never on a sandbox's link to this machine.
        assert list(cable.hosts()) == [here, there] and cable.subnet_of(network.CABLE_NETWORK)
        assert not cable.overlaps(links)
    # A name the kernel takes (15 characters at most), beside the guest's eth0.
    assert len(network.CABLE_INTERFACE) <= 15 and network.CABLE_INTERFACE != network.GUEST_INTERFACE


def test_the_cable_is_laid_between_the_two_namespaces_only() -> None:
    """One veth pair with an end in each sandbox's namespace (nothing on this machine), both ends
    at MTU 9000, addressed on the cable's /30 and up."""
    mtu = ["mtu", "9000"]
    assert [command for _, command in network.cable_steps("a", "b", 7)] == [
        [
            "ip",
            "-n",
            "sfsb-a",
            "link",
            "add",
            "cx7",
            *mtu,
            "type",
            "veth",
            "peer",
            "name",
            "cx7",
            *mtu,
            "netns",
            "sfsb-b",
        ],
        ["ip", "-n", "sfsb-a", "addr", "add", "10.234.7.1/30", "dev", "cx7"],
        ["ip", "-n", "sfsb-b", "addr", "add", "10.234.7.2/30", "dev", "cx7"],
        ["ip", "-n", "sfsb-a", "link", "set", "cx7", "up"],
        ["ip", "-n", "sfsb-b", "link", "set", "cx7", "up"],
    ]


def test_a_cable_record_is_read_back_checked(runtime_root: Path) -> None:
    folder = fake_up(runtime_root, "a", 7)
    assert network.read_cable(folder) is None
    cable = network.Cable(peer="b", address="10.234.7.1", peer_address="10.234.7.2")
    network.write_cable(folder, cable)
    assert network.read_cable(folder) == cable
    assert cable.seen_from_peer("a") == network.Cable(peer="a", address="10.234.7.2", peer_address="10.234.7.1")
    assert str(cable) == "cx7 10.234.7.1/30 <-> b 10.234.7.2 (mtu 9000)"
    for bad in ({"peer": "b; rm -rf /"}, {"address": "10.233.7.2"}, {"peer_address": "not an address"}):
        (folder / network.CABLE_RECORD).write_text(json.dumps({**asdict(cable), **bad}))
        with pytest.raises(SandboxError, match="is not a cable record sparkform wrote"):
            network.read_cable(folder)
    (folder / network.CABLE_RECORD).write_text("{}")
    with pytest.raises(SandboxError, match="is not a cable record"):
        network.read_cable(folder)


def test_link_refuses_itself_a_machine_that_is_not_up_and_a_third_machine(
    runtime_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All refused before a command runs: no `ip` on this machine is needed to get here."""
    for name, index in (("a", 1), ("b", 2), ("c", 3)):
        fake_up(runtime_root, name, index)
    with pytest.raises(SandboxError, match="cannot link sandbox 'a' to itself"):
        machine.link("a", "a")
    with pytest.raises(SandboxError, match="sandbox 'a' is not up: `sparkform sandbox --name a up` it first"):
        machine.link("a", "b")
    monkeypatch.setattr(registry, "in_use", lambda folder: True)
    with pytest.raises(SandboxError, match="sandbox 'z' is not up"):
        machine.link("a", "z")
    network.write_cable(runtime_root / "c", network.Cable(peer="b", address="10.234.3.1", peer_address="10.234.3.2"))
    network.write_cable(runtime_root / "b", network.Cable(peer="c", address="10.234.3.2", peer_address="10.234.3.1"))
    with pytest.raises(SandboxError, match="sandbox 'b' is cabled to 'c'"):
        machine.link("a", "b")


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


def test_sandbox_link_with_name_before_or_after_the_action(
    runtime_root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[tuple[str, str]] = []

    def link(name: str, peer: str) -> network.Cable:
        calls.append((name, peer))
        return network.Cable(peer=peer, address="10.234.1.1", peer_address="10.234.1.2")

    monkeypatch.setattr(machine, "link", link)
    assert cli.main(["sandbox", "--name", "a", "link", "b"]) == 0
    assert cli.main(["sandbox", "link", "b", "--name", "c"]) == 0
    assert calls == [("a", "b"), ("c", "b")]
    assert capsys.readouterr().out.splitlines() == ["cx7 10.234.1.1/30 <-> b 10.234.1.2 (mtu 9000)"] * 2
    with pytest.raises(SystemExit) as exit_:
        cli.main(["sandbox", "--name", "a", "link"])  # no peer
    assert exit_.value.code == 2 and len(calls) == 2


def test_sandbox_status_shows_the_cable(runtime_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cable = network.Cable(peer="b", address="10.234.1.1", peer_address="10.234.1.2")
    network.write_cable(fake_up(runtime_root, "a", 1), cable)
    assert cli.main(["sandbox", "status", "--name", "a", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cable"] == asdict(cable)


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


@pytest.mark.parametrize("layer", ["/no/such/layer", "/tmp/a:b"])
def test_a_layer_not_a_folder_or_holding_a_colon_is_refused_before_booting(layer):
    with pytest.raises(SandboxError, match="bad layer"):
        machine.up("t-badlayer", layers=[Path(layer)])
    assert not registry.runtime_dir("t-badlayer").exists()


def test_the_venv_layer_keeps_only_the_venv_and_the_folders_above_it(tmp_path):
    upper = tmp_path / "upper"
    venv = upper / "opt/sparkform/venvs/v1"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin/python").symlink_to("/usr/bin/python3")
    for stray in ("opt/sparkform/other", "etc/resolv.conf", "root/.cache/pip/x", "opt/stray.txt"):
        (upper / stray).parent.mkdir(parents=True, exist_ok=True)
        (upper / stray).write_text("x")
    keep_only(upper, "/opt/sparkform/venvs/v1")
    kept = sorted(str(p.relative_to(upper)) for p in upper.rglob("*"))
    assert kept == [
        "opt",
        "opt/sparkform",
        "opt/sparkform/venvs",
        "opt/sparkform/venvs/v1",
        "opt/sparkform/venvs/v1/bin",
        "opt/sparkform/venvs/v1/bin/python",
    ]
