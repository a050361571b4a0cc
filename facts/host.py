"""SparkformHost: everything a converge decides on, gathered in one SSH round trip.

pyinfra 3.10 does not cache facts, so a no-op run costs one round trip per fact call; the
deploy reads this one fact once and every task decides from it.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from pyinfra.api import FactBase

from sparkform.parsers import EngineState, engine_states
from sparkform.schema import CHECKPOINT_MANIFEST

UNIT_PROPERTIES = "Id,LoadState,ActiveState,SubState,NRestarts,MainPID,ExecMainStatus,Result,UnitFileState"
SECTION = "@@sparkform:"
# Trusts a checkpoint's manifest by size and mtime, hashing nothing: prints "folder|ok" or
# "folder|<files that differ>" for each folder that has a manifest.
MANIFEST_CHECK = f"""
import json, os, sys
for folder in sys.argv[1:]:
    try:
        files = json.load(open(os.path.join(folder, "{CHECKPOINT_MANIFEST}")))["files"]
    except (OSError, ValueError):
        continue
    def same(entry):
        try:
            st = os.stat(os.path.join(folder, entry["path"]))
        except OSError:
            return False
        return st.st_size == entry["size"] and abs(st.st_mtime - entry["mtime"]) < 1e-3
    print(folder + "|" + (",".join(e["path"] for e in files if not same(e)) or "ok"))
"""


@dataclass(frozen=True)
class RemoteFile:
    sha256: str | None  # None for a directory
    mode: str
    user: str
    group: str


@dataclass
class HostSnapshot:
    installed_packages: set[str] = field(default_factory=set)
    users: set[str] = field(default_factory=set)
    paths: dict[str, RemoteFile] = field(default_factory=dict)
    markers: dict[str, str] = field(default_factory=dict)  # completion marker path -> content
    rendered_units: set[str] = field(default_factory=set)  # unit files sparkform wrote, by path
    # checkpoint folder -> files whose size or mtime no longer match its manifest ([] when intact)
    checkpoint_drift: dict[str, list[str]] = field(default_factory=dict)
    engines: dict[str, EngineState] = field(default_factory=dict)


def _section(name: str, command: str) -> str:
    return f"echo {SECTION}{name}; {{ {command} ; }} 2>/dev/null || true"


class SparkformHost(FactBase):
    """
    The host's state as far as sparkform manages it, in one command.

    + packages: Debian packages to look up
    + users: system users to look up
    + paths: files and folders to stat (files are also hashed)
    + markers: completion markers to read (venv, checkpoints)
    + units: systemd units to show
    + unit_glob: unit files to look through for sparkform's header (finds units of engines that
      left the inventory)
    + checkpoints: checkpoint folders whose manifest to check by size and mtime
    """

    default = HostSnapshot

    def command(self, packages: list[str], users: list[str], paths: list[str],
                markers: list[str], units: list[str], unit_glob: str, checkpoints: list[str]) -> str:
        quoted_paths = " ".join(shlex.quote(p) for p in paths)
        sections = [
            _section("packages", "dpkg-query -W -f='${Package} ${db:Status-Status}\\n' "
                     + " ".join(shlex.quote(p) for p in packages)),
            _section("users", " ; ".join(f"getent passwd {shlex.quote(u)}" for u in users)),
            _section("stat", f"stat -c '%F|%a|%U|%G|%n' {quoted_paths}"),
            _section("sha256", f"sha256sum {quoted_paths}"),
            _section("markers", " ; ".join(
                f"test -f {shlex.quote(m)} && printf '%s|%s\\n' {shlex.quote(m)} \"$(cat {shlex.quote(m)})\""
                for m in markers) or "true"),
            _section("units", f"systemctl show -p {UNIT_PROPERTIES} "
                     + " ".join(shlex.quote(u) for u in units)),
            _section("rendered_units", f"grep -l '^# Rendered by sparkform' {unit_glob}"),
            _section("manifests", f"python3 -c {shlex.quote(MANIFEST_CHECK)} "
                     + " ".join(shlex.quote(c) for c in checkpoints)),
        ]
        return " ; ".join(sections)

    def process(self, output: list[str]) -> HostSnapshot:
        sections: dict[str, list[str]] = {}
        current: list[str] = []
        for line in output:
            if line.startswith(SECTION):
                current = sections.setdefault(line[len(SECTION):], [])
            else:
                current.append(line)
        snapshot = HostSnapshot()
        for line in sections.get("packages", []):
            name, _, status = line.partition(" ")
            if status == "installed":
                snapshot.installed_packages.add(name)
        snapshot.users = {line.split(":", 1)[0] for line in sections.get("users", []) if ":" in line}
        digests = {}
        for line in sections.get("sha256", []):
            digest, _, path = line.partition("  ")
            digests[path] = digest
        for line in sections.get("stat", []):
            kind, mode, user, group, path = line.split("|", 4)
            snapshot.paths[path] = RemoteFile(None if kind == "directory" else digests.get(path),
                                              mode, user, group)
        for line in sections.get("markers", []):
            path, _, content = line.partition("|")
            snapshot.markers[path] = content
        snapshot.engines = engine_states(sections.get("units", []))
        snapshot.rendered_units = set(sections.get("rendered_units", []))
        for line in sections.get("manifests", []):
            folder, _, verdict = line.rpartition("|")
            snapshot.checkpoint_drift[folder] = [] if verdict == "ok" else verdict.split(",")
        return snapshot
