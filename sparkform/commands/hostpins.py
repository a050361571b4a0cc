"""`sparkform render`'s question to a host: which commit each branch or tag resolved to there.

The deploy pins a branch or tag to the commit it names once and records it on the host
(sparkform/commands/hub.py); render writes those commits, as the deploy does, by reading the host's pins
over SSH in one round trip, checked as the deploy checks them (sparkform/readers/readback.py). When it
cannot ask, render writes the revision as written and `why_not` says why.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkform.commands import ssh
from sparkform.domain.engine import Engine
from sparkform.domain.schema import HostConfig
from sparkform.readers import readback, remote

ASK_TIMEOUT_S = 30


@dataclass(frozen=True)
class Answer:
    pins: dict[str, str] = field(default_factory=dict)  # pin name (repo@revision) -> commit
    why_not: str | None = None  # why the host was not asked or did not answer; None when it did


def unpinned(config: HostConfig) -> list[Engine]:
    """The engines whose checkpoint names a branch or tag the config has no commit for."""
    return [engine for engine in config.engines if config.commit(engine) is None]


def ask(host_name: str, data: dict[str, Any], config: HostConfig, folder: Path) -> Answer:
    """The host's recorded pins, over SSH with its pyinfra connection data."""
    ssh_config = ssh.write_config(host_name, data, folder)
    try:
        # A section's status is always 0: only ssh's own 255 means no answer.
        result = ssh.run(
            ssh_config, host_name, remote.section("pins", readback.pins_command(config.pins_dir)), ASK_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return Answer(why_not=f"no answer over SSH within {ASK_TIMEOUT_S} s")
    if result.returncode != 0:
        return Answer(why_not=f"does not answer over SSH ({ssh.failure(result)})")
    sections, links = remote.split_sections(result.stdout.splitlines())
    untrusted = [f"{path} is a symbolic link, where sparkform writes a plain file" for path in links]
    pins = readback.pins(sections.get("pins", []), untrusted)
    if untrusted:
        return Answer(why_not=f"its pins are not what sparkform writes: {untrusted[0]}")
    return Answer(pins)


def pinned(config: HostConfig, answer: Answer) -> HostConfig:
    """The config with the commits the host recorded for its branches and tags."""
    recorded = {
        e.name: answer.pins[e.checkpoint.pin_name] for e in unpinned(config) if e.checkpoint.pin_name in answer.pins
    }
    return config.pinned(recorded)


def written_instead(host_name: str, config: HostConfig, answer: Answer) -> str | None:
    """One line naming the host, why a branch or tag kept its name, and what render wrote instead
    of the commit (`config`: pinned with the answer); None when every engine got its commit."""
    left = unpinned(config)
    if not left:
        return None
    names = ", ".join(f"{e.checkpoint.repo}@{e.checkpoint.revision}" for e in left)
    why = answer.why_not or f"the host records no commit for {names} (not deployed yet)"
    return (
        f"sparkform render: {host_name}: {why}; wrote the revision as named ({names}) where a deploy "
        "writes the commit it pins"
    )
