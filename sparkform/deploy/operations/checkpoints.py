"""Checkpoints: fetched and verified on the host, one folder per repo@commit; old revisions removed
only after the new one serves."""

from __future__ import annotations

import shlex

from pyinfra import host
from pyinfra.api import operation

from sparkform.deploy.operations.files import replaced_file
from sparkform.deploy.operations.progress import PROGRESS_EVERY_S, ProgressCommand
from sparkform.deploy.operations.venv import own_pattern
from sparkform.domain.engine import Engine
from sparkform.domain.layout import COMPLETE_MARKER
from sparkform.domain.schema import HostConfig
from sparkform.readers.snapshot import Snapshot
from sparkform.writers.converge import checkpoint_complete, kept_checkpoints
from sparkform.writers.programs import checkpoint_fetch


@operation()
def checkpoint(config: HostConfig, engine: Engine, snapshot: Snapshot):
    """
    Fetch and verify an engine's checkpoint at its pinned commit unless its folder is complete
    and every file still has the size and mtime its manifest recorded (a no-op run hashes
    nothing); then record what a branch or tag resolved to, so later runs keep that commit.

    `sparkform-checkpoint` (rendered from templates/) checks the free space, downloads
    `checkpoint_workers` files at once, hashing each as it streams in, compares every file with
    the hub's tree (sha256 for the weights, git's blob id for the others), resumes a cut download,
    re-fetches a file that differs, and writes the manifest and the marker last. The token is read
    from its 0600 file by the remote shell, so it never appears in argv, in pyinfra's output or in
    a unit.

    + config: the host's validated configuration, pinned (HostConfig.pinned)
    + engine: the engine whose checkpoint this is
    + snapshot: the host's state from the HostSnapshot fact
    """
    folder = config.checkpoint_dir(engine)
    commit = config.commit(engine)
    assert commit is not None, "the deploy runs on a pinned configuration"
    current = snapshot.checkpoints.get(folder)
    complete = checkpoint_complete(config, engine, snapshot)
    if not complete:
        yield from _fetch(config, engine, folder, drifted=current is not None and bool(current.drift))
    if engine.checkpoint.revision != commit and snapshot.pins.get(engine.checkpoint.pin_name) != commit:
        yield replaced_file(config.pin_path(engine), commit)
    elif complete:
        host.noop(f"{engine.checkpoint.repo}@{commit} is complete")


def _fetch(config: HostConfig, engine: Engine, folder: str, drifted: bool):
    env = ["HF_HUB_DISABLE_TELEMETRY=1"]
    if config.hf_endpoint:
        env.append(f"HF_ENDPOINT={shlex.quote(config.hf_endpoint)}")
    if config.hf_token_file:
        env.append(f'HF_TOKEN="$(cat {shlex.quote(config.paths.hf_token)})"')
    script = config.paths.checkpoint
    if drifted:
        # Files changed since they were verified: the engine must not start on them meanwhile.
        yield f"rm -f {shlex.quote(f'{folder}/{COMPLETE_MARKER}')}"
    # A deploy cut off mid-download can leave its fetch running: stop it first.
    yield f"pkill -f -- {shlex.quote(own_pattern(f'{script} {engine.checkpoint.repo} '))} || true"
    # Shell assignments, not `env NAME=value`: env's own argv would show the token in `ps`. Its
    # lines (one per file, and every PROGRESS_EVERY_S seconds while a file downloads) show live.
    yield ProgressCommand(
        f"{' '.join(env)} {shlex.join(checkpoint_fetch(config, engine))} --progress-every {PROGRESS_EVERY_S}"
    )


def stale_revisions(config: HostConfig, snapshot: Snapshot) -> list[str]:
    """Folders of older revisions of the repos the engines serve, beyond `keep_revisions`
    (newest kept first); never a folder any engine (disabled ones too) is pinned to, nor one an
    engine's kept settings load (a rollback needs it)."""
    if config.keep_revisions is None:
        return []
    pinned = {config.checkpoint_dir(engine) for engine in config.engines} | kept_checkpoints(snapshot)
    stale = []
    for prefix in sorted({f"{config.models_dir}/{e.checkpoint.folder_prefix}" for e in config.engines}):
        older = sorted(
            (path for path in snapshot.checkpoints if path.startswith(prefix) and path not in pinned),
            key=lambda path: snapshot.checkpoints[path].mtime,
            reverse=True,
        )
        stale += older[config.keep_revisions :]
    return stale


@operation()
def old_revisions_removed(config: HostConfig, snapshot: Snapshot):
    """
    Remove checkpoint folders of old revisions the inventory no longer keeps
    (`keep_revisions`), and the pins that name them. Runs after every engine serves its
    pinned commit, so a bad new checkpoint never leaves the box without a model.

    + config: the host's validated configuration, pinned (HostConfig.pinned)
    + snapshot: the host's state from the HostSnapshot fact
    """
    stale = stale_revisions(config, snapshot)
    if not stale:
        host.noop("no old revision to remove")
        return
    commits = {path.rsplit("@", 1)[1] for path in stale}
    for name, commit in sorted(snapshot.pins.items()):
        if commit in commits:
            yield f"rm -f {shlex.quote(f'{config.pins_dir}/{name}')}"
    for path in stale:
        yield f"rm -rf -- {shlex.quote(path)}"
