"""Checkpoints: downloaded on the host with the real `hf download`, one folder per repo@revision."""

from __future__ import annotations

import shlex

from pyinfra import host
from pyinfra.api import operation

from facts.host import HostSnapshot
from sparkform.schema import COMPLETE_MARKER, Engine, HostConfig
from tasks.venv import own_pattern

def marker_path(config: HostConfig, engine: Engine) -> str:
    return f"{config.checkpoint_dir(engine)}/{COMPLETE_MARKER}"


@operation()
def checkpoint(config: HostConfig, engine: Engine, snapshot: HostSnapshot):
    """
    Fetch and verify an engine's checkpoint unless its completion marker is there and every
    file still has the size and mtime its manifest recorded (a no-op run hashes nothing).

    `sparkform-checkpoint` (rendered from templates/) checks the free space, downloads, compares
    every file with the hub's tree (sha256 for the weights), re-fetches a file that differs, and
    writes the manifest and the marker last. The token is read from its 0600 file by the remote
    shell, so it never appears in argv, in pyinfra's output or in a unit.

    + config: the host's validated configuration
    + engine: the engine whose checkpoint this is
    + snapshot: the host's state from the SparkformHost fact
    """
    marker = marker_path(config, engine)
    drift = snapshot.checkpoint_drift.get(config.checkpoint_dir(engine), [])
    if marker in snapshot.markers and not drift:
        host.noop(f"{engine.checkpoint.repo}@{engine.checkpoint.revision} is complete")
        return
    env = ["HF_HUB_DISABLE_TELEMETRY=1"]
    if config.hf_endpoint:
        env.append(f"HF_ENDPOINT={shlex.quote(config.hf_endpoint)}")
    if config.hf_token_file:
        env.append(f'HF_TOKEN="$(cat {shlex.quote(config.hf_token_path)})"')
    includes = "".join(f" --include {shlex.quote(p)}" for p in engine.checkpoint.include)
    script = f"{config.lib_dir}/sparkform-checkpoint"
    repo = shlex.quote(engine.checkpoint.repo)
    if drift:
        # Files changed since they were verified: the engine must not start on them meanwhile.
        yield f"rm -f {shlex.quote(marker)}"
    # A deploy cut off mid-download can leave its fetch running: stop it first.
    yield f"pkill -f -- {shlex.quote(own_pattern(f'{script} {engine.checkpoint.repo} '))} || true"
    yield (f"env {' '.join(env)} {shlex.quote(config.venv)}/bin/python {shlex.quote(script)} {repo} "
           f"{shlex.quote(engine.checkpoint.revision)} {shlex.quote(config.checkpoint_dir(engine))}{includes}")
