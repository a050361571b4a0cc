"""The verification suite's hosts: read from a pyinfra inventory, reached with testinfra over SSH.

    sparkform verify inventory/spark.py      (runs: pytest tests/verify --inventory ...)

The same suite checks the sandbox and a real Spark. testinfra has no pyinfra backend, so an SSH
config is written from each host's pyinfra data (ssh_hostname, ssh_user, ssh_port, ssh_key,
ssh_known_hosts_file, ssh_strict_host_key_checking).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import testinfra

from sparkform.inventory import load_inventory, raw_inventory
from sparkform.schema import HostConfig


def pytest_addoption(parser):
    parser.addoption("--inventory", required=True, type=Path, help="pyinfra inventory to verify")
    parser.addoption("--deep", action="store_true", help="also re-hash every checkpoint file")


@dataclass(frozen=True)
class Target:
    name: str
    config: HostConfig
    ssh_data: dict

    def __str__(self) -> str:
        return self.name


def _ssh_config(target_name: str, data: dict, folder: Path) -> Path:
    lines = [f"Host {target_name}", f"  HostName {data.get('ssh_hostname', target_name)}",
             f"  User {data.get('ssh_user', 'root')}", "  BatchMode yes",
             "  ControlMaster auto", f"  ControlPath {folder}/cm-%C", "  ControlPersist 60"]
    if data.get("ssh_port"):
        lines.append(f"  Port {data['ssh_port']}")
    if data.get("ssh_key"):
        lines.append(f"  IdentityFile {data['ssh_key']}")
    if data.get("ssh_known_hosts_file"):
        lines.append(f"  UserKnownHostsFile {data['ssh_known_hosts_file']}")
    strict = data.get("ssh_strict_host_key_checking")
    if strict is not None:
        lines.append(f"  StrictHostKeyChecking {strict}")
    path = folder / f"{target_name}.ssh_config"
    path.write_text("\n".join(lines) + "\n")
    return path


def _targets(config) -> list[Target]:
    hosts = load_inventory(config.getoption("--inventory"))
    raw = raw_inventory(config.getoption("--inventory"))
    return [Target(host.name, host.config, raw[host.name]) for host in hosts]


def pytest_generate_tests(metafunc):
    """Every test runs per host; a test that takes `engine` runs per enabled engine of each host."""
    targets = _targets(metafunc.config)
    if "engine" in metafunc.fixturenames:
        cases = [(t, e) for t in targets for e in t.config.enabled_engines]
        metafunc.parametrize(("target", "engine"), cases, ids=[f"{t}-{e.name}" for t, e in cases])
    elif "target" in metafunc.fixturenames:
        metafunc.parametrize("target", targets, ids=[str(t) for t in targets])


@pytest.fixture(scope="session")
def ssh_folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ssh")


_hosts: dict[str, testinfra.host.Host] = {}


@pytest.fixture
def remote(target, ssh_folder):
    """The testinfra host of the test's target, one SSH master per host for the session."""
    if target.name not in _hosts:
        alias = target.name.replace("@", "").replace("/", "_")
        ssh_config = _ssh_config(alias, target.ssh_data, ssh_folder)
        _hosts[target.name] = testinfra.get_host(f"ssh://{alias}", ssh_config=str(ssh_config))
    return _hosts[target.name]


@pytest.fixture
def config(target) -> HostConfig:
    return target.config
