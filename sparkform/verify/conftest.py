"""The verification suite's hosts: read from a pyinfra inventory, reached with testinfra over SSH.

    sparkform verify inventory/spark.py      (runs: pytest sparkform/verify --inventory ...)

The same suite checks the sandbox and a real Spark. testinfra has no pyinfra backend, so an SSH
config is written from each host's pyinfra data (sparkform.commands.ssh).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import testinfra

from sparkform.commands import ssh
from sparkform.domain.schema import HostConfig
from sparkform.rules import nodes
from sparkform.rules.inventory import load_inventory, raw_inventory


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


def _targets(config) -> list[Target]:
    hosts = load_inventory(config.getoption("--inventory"))
    raw = raw_inventory(config.getoption("--inventory"))
    return [Target(host.name, host.config, raw[host.name]) for host in hosts]


def pytest_generate_tests(metafunc):
    """Every test runs per host; a test that takes `engine` runs per engine whose API a host
    serves, one that takes `rank` per rank a host runs headless for a head elsewhere."""
    targets = _targets(metafunc.config)
    if "engine" in metafunc.fixturenames:
        cases = [(t, e) for t in targets for e in t.config.served_engines]
        metafunc.parametrize(("target", "engine"), cases, ids=[f"{t}-{e.name}" for t, e in cases])
    elif "rank" in metafunc.fixturenames:
        cases = [(t, e) for t in targets for e in t.config.enabled_engines if t.config.is_worker(e)]
        # None: one case that says why in words (pytest's own reason would be "got empty parameter set").
        none = pytest.param(None, None, marks=pytest.mark.skip(reason="no host runs a rank of an engine across hosts"))
        metafunc.parametrize(("target", "rank"), cases or [none], ids=[f"{t}-{e.name}" for t, e in cases] or ["none"])
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
        ssh_config = ssh.write_config(target.name, target.ssh_data, ssh_folder)
        _hosts[target.name] = testinfra.get_host(f"ssh://{ssh.alias(target.name)}", ssh_config=str(ssh_config))
    return _hosts[target.name]


_pinned: dict[str, HostConfig] = {}


@pytest.fixture
def config(request, target, remote) -> HostConfig:
    """The target's config with each branch or tag pinned to the commit the host recorded, and
    each engine across hosts placed as the deploy places it, from the host's link (read once per
    host for the session)."""
    if target.name not in _pinned:
        recorded = {}
        for engine in target.config.engines:
            pin = remote.file(target.config.pin_path(engine))
            if target.config.commit(engine) is None and pin.exists:
                recorded[engine.name] = pin.content_string.strip()
        config = target.config.pinned(recorded)
        if config.node_interface and (spanning := [e for e in config.enabled_engines if e.nodes]):
            command = nodes.node_link_command(config.node_interface, config.pin(spanning[0]).venv, None)
            link = nodes.parse_node_link(config.node_interface, remote.check_output(command).splitlines())
            peers = {other.name: other.config for other in _targets(request.config)}
            spans, problems = nodes.spans(target.name, config, peers, link)
            assert not problems, "\n".join(str(problem) for problem in problems)
            config = config.spanned(spans)
        _pinned[target.name] = config
    return _pinned[target.name]
