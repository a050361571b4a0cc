"""JIT caches keyed by what invalidates them: moved aside on drift, rebuilt by one warm start at a
time, removed only once that start served."""

from __future__ import annotations

import shlex

from pyinfra import host
from pyinfra.api import operation

from sparkform.deploy.operations.files import replaced_file
from sparkform.domain.engine import Engine
from sparkform.domain.layout import cache_keys_dir
from sparkform.domain.schema import HostConfig
from sparkform.readers.hostrecord import STALE_MARK
from sparkform.readers.snapshot import Snapshot
from sparkform.writers.converge import caches_aside


@operation()
def cache_moved_aside(config: HostConfig, engine: Engine, snapshot: Snapshot):
    """
    Stop an engine whose JIT caches were built under other versions and give it an empty
    cache folder. The stale caches are moved aside, not deleted, until a warm start on the new
    versions has served (a failed one keeps them for a retry); caches a previous run already
    moved aside stay, and what that run's failed warm start left is dropped.

    + config: the host's validated configuration
    + engine: the engine with stale caches
    + snapshot: the host's state from the HostSnapshot fact
    """
    cache = config.engine_cache_dir(engine)
    user = config.engine_user
    yield f"systemctl stop {shlex.quote(engine.unit)}"
    if caches_aside(config, engine, snapshot):
        yield f"rm -rf -- {shlex.quote(cache)}"
    else:
        old_key = snapshot.cache_keys.get(engine.name, "unkeyed")
        yield f"mv -- {shlex.quote(cache)} {shlex.quote(f'{cache}{STALE_MARK}{old_key}')}"
    yield f"install -d -m 750 -o {user} -g {user} {shlex.quote(cache)}"


@operation()
def cache_keyed(config: HostConfig, engine: Engine, key: str, snapshot: Snapshot, rebuilt: bool):
    """
    After the engine served: write the key its caches are valid for, and delete the caches
    moved aside for it.

    + config: the host's validated configuration
    + engine: the engine, serving
    + key: the live cache key (sparkform.readers.hostrecord.cache_key)
    + snapshot: the host's state from the HostSnapshot fact
    + rebuilt: this run moved its caches aside
    """
    cache = config.engine_cache_dir(engine)
    changed = False
    if snapshot.cache_keys.get(engine.name) != key or rebuilt:
        yield replaced_file(f"{cache_keys_dir(config.state_dir)}/{engine.name}", key)
        changed = True
    if rebuilt or caches_aside(config, engine, snapshot):
        yield f"rm -rf -- {shlex.quote(cache)}{STALE_MARK}*"
        changed = True
    if not changed:
        host.noop(f"JIT caches of {engine.name} are keyed {key}")
