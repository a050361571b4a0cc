"""A host as one converge sees it: the value sparkform/deploy/facts/snapshot.py gathers in one SSH round trip.

Pure data: the deploy's plan (sparkform/writers/converge.py) and every operation decide from it, and
tests build one by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sparkform.readers.hostrecord import HostRecord
from sparkform.readers.kept import KeptSettings, Rollback
from sparkform.readers.parsers import EngineState


@dataclass(frozen=True)
class RemoteFile:
    sha256: str | None  # None for a directory or a symbolic link
    mode: str
    user: str
    group: str
    link: bool = False  # a symbolic link stands at the path (stat's own answer, never followed)


@dataclass(frozen=True)
class CheckpointFolder:
    marker: str | None  # the completion marker's content (the commit), None when unfinished
    drift: list[str] | None  # files whose size or mtime left the manifest; None: no manifest
    mtime: float


@dataclass
class Snapshot:
    installed_packages: set[str] = field(default_factory=set)
    users: dict[str, str] = field(default_factory=dict)  # user -> home folder
    paths: dict[str, RemoteFile] = field(default_factory=dict)
    markers: dict[str, str] = field(default_factory=dict)  # marker or stamp path -> its one line
    rendered_units: set[str] = field(default_factory=set)  # unit files sparkform wrote, by path
    checkpoints: dict[str, CheckpointFolder] = field(default_factory=dict)  # by folder path
    pins: dict[str, str] = field(default_factory=dict)  # pin name (repo@revision) -> commit
    live_versions: list[str] = field(default_factory=list)  # LIVE_VERSIONS_COMMAND's output
    record: HostRecord | None = None  # None before the first converge, or when it is no record
    booted_at: float | None = None  # unix time systemd (PID 1) started: this boot, also in a container
    cache_keys: dict[str, str] = field(default_factory=dict)  # engine -> key its caches were built under
    caches_aside: list[str] = field(default_factory=list)  # cache folders moved aside, not yet rebuilt
    unit_files: dict[str, str] = field(default_factory=dict)  # engine unit file -> enabled, disabled, ...
    order_blind: dict[str, str] = field(default_factory=dict)  # engine unit path -> bootchain.order_blind_digest
    engines: dict[str, EngineState] = field(default_factory=dict)
    kept: dict[str, KeptSettings] = field(default_factory=dict)  # engine -> the settings it last served with
    previous: dict[str, KeptSettings] = field(default_factory=dict)  # engine -> those it served before them
    rollbacks: dict[str, Rollback] = field(default_factory=dict)  # engine -> its kept settings were put back
    venvs: list[str] = field(default_factory=list)  # the names of the venv folders under venv_root
    front_certificate: str | None = None  # the front's certificate (PEM) when TLS is on and the host has one
    worker_connections: int | None = None  # nginx.conf's worker_connections (None: no such line)
    # What the host holds that sparkform never writes (file and value): root acts on none of it.
    untrusted: list[str] = field(default_factory=list)

    def planted_links(self, unwanted_paths: list[str]) -> list[str]:
        """The paths sparkform manages where a symbolic link stands, folders first (a link at a
        folder would send its chmod/chown and every file below it elsewhere), as untrusted findings:
        root follows no link it did not make. A link where sparkform removes a file is removed as
        it is (rm follows nothing)."""
        removed = set(unwanted_paths)
        links = [path for path, current in self.paths.items() if current.link and path not in removed]
        return [
            f"{path} is a symbolic link (to wherever it points): sparkform makes a plain folder or file there, "
            "and root follows no link; an owner who moved the folder names its real path in the inventory"
            for path in links
        ]
