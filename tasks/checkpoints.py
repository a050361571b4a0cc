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
    Download an engine's checkpoint unless its completion marker is there.

    The token is read from its 0600 file by the remote shell, so it never appears in argv, in
    pyinfra's output or in a unit. A rerun keeps the files `hf download` finished and fetches a
    cut one again; the marker is written only after the whole download succeeded.

    + config: the host's validated configuration
    + engine: the engine whose checkpoint this is
    + snapshot: the host's state from the SparkformHost fact
    """
    marker = marker_path(config, engine)
    if marker in snapshot.markers:
        host.noop(f"{engine.checkpoint.repo}@{engine.checkpoint.revision} is complete")
        return
    folder = shlex.quote(config.checkpoint_dir(engine))
    env = ["HF_HUB_DISABLE_TELEMETRY=1"]
    if config.hf_endpoint:
        env.append(f"HF_ENDPOINT={shlex.quote(config.hf_endpoint)}")
    if config.hf_token_file:
        env.append(f'HF_TOKEN="$(cat {shlex.quote(config.hf_token_path)})"')
    includes = "".join(f" --include {shlex.quote(p)}" for p in engine.checkpoint.include)
    # A deploy cut off mid-download can leave its `hf download` running: stop it first.
    yield f"pkill -f -- {shlex.quote(own_pattern(f'hf download {engine.checkpoint.repo} '))} || true"
    yield f"install -d -m 755 {folder}"
    yield (f"env {' '.join(env)} {shlex.quote(config.venv)}/bin/hf download "
           f"{shlex.quote(engine.checkpoint.repo)} --revision {shlex.quote(engine.checkpoint.revision)}"
           f" --local-dir {folder}{includes} --quiet")
    yield f"touch {shlex.quote(marker)}"
