"""HostSnapshot: everything a converge decides on, gathered in one SSH round trip.

pyinfra 3.10 does not cache facts, so a no-op run costs one round trip per fact call; the
deploy reads this one fact once and every task decides from it.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
from collections.abc import Callable
from importlib import resources
from typing import Any

from pyinfra.api import FactBase

from sparkform.domain.layout import (
    CHECKPOINT_MANIFEST,
    COMPLETE_MARKER,
    KEPT_PREVIOUS,
    KEPT_RECORD,
    NGINX_MAIN_CONFIG,
    ROLLBACK_RECORD,
)
from sparkform.domain.shapes import COMMIT_ID
from sparkform.readers.hostrecord import (
    CACHE_KEY_PATTERN,
    ENGINE_NAME_PATTERN,
    LIVE_VERSIONS_COMMAND,
    STALE_MARK,
    HostRecord,
    UntrustedValue,
)
from sparkform.readers.kept import KeptSettings, Rollback
from sparkform.readers.parsers import SYSTEMCTL_SHOW_PROPERTIES, engine_states
from sparkform.readers.readback import REPO_AT, named_lines, pins, pins_command, shaped
from sparkform.readers.remote import plain_file, plain_files, section, split_sections
from sparkform.readers.snapshot import CheckpointFolder, RemoteFile, Snapshot
from sparkform.rules.bootchain import ORDERING
from sparkform.rules.front_tls import read_back, read_command

# What sparkform writes into the files it reads back; anything else was written by someone else.
STAMP = re.compile(r"[A-Za-z0-9._+=@ -]{0,200}")  # venv pins, digests of what nginx and the guard loaded
UNIT_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]*\.service")  # a unit sparkform may have written
MANIFEST_PATH = re.compile(r"[A-Za-z0-9._/+-]{1,400}")  # a checkpoint file, relative to its folder
WORKER_CONNECTIONS = re.compile(r"\s*worker_connections\s+([0-9]{1,6})\s*;.*")  # nginx.conf's line
# A venv folder's name as HostConfig.pin names it: <package>-<version>-<lock id>.
VENV_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+!-]{0,160}-[0-9a-f]{12}")
SHA256 = re.compile(r"[0-9a-f]{64}")


def order_blind_command(paths: list[str]) -> str:
    """For each of `paths` that is a plain file: its order-blind digest (bootchain.order_blind_digest)
    and its path; a symbolic link is never followed."""
    return (
        "; ".join(
            f"if [ -f {q} ] && [ ! -L {q} ]; then echo $(grep -v '^{ORDERING}' {q} | sha256sum | cut -c1-64) {q}; fi"
            for q in map(shlex.quote, paths)
        )
        or "true"
    )


def checkpoint_scan_command(models_dir: str) -> str:
    """The no-op check of every checkpoint folder under `models_dir`: checkpoint_scan.py beside
    this module, its text on the command line (the fact runs before any deploy put a file on the host)."""
    source = resources.files(__package__).joinpath("checkpoint_scan.py").read_text(encoding="utf-8")
    return shlex.join(["python3", "-c", source, models_dir, COMPLETE_MARKER, CHECKPOINT_MANIFEST])


class HostSnapshot(FactBase):
    """
    The host's state as far as sparkform manages it, in one command.

    + packages: Debian packages to look up
    + users: system users to look up
    + paths: files and folders to stat (files are also hashed)
    + markers: one-line files to read: the venv's completion marker, the stamps of what nginx and
      the guard last (re)started with
    + units: systemd units to show
    + unit_glob: unit files to look through for sparkform's header (finds units of engines that
      left the inventory); those among `paths` are also hashed without their After= lines
    + models_dir: folder of the checkpoint folders, each checked against its manifest by size
      and mtime
    + pins_dir: folder of the records of what each branch or tag resolved to
    + cache_root: folder of the engines' JIT cache folders (and those moved aside)
    + cache_keys_dir: root's folder of the key each engine's caches were built under
    + record_path: the host record
    + kept_root: root's folder of each engine's kept settings (kept.json, rolled-back.json, and
      previous/kept.json)
    + venv_root: the folder of the vLLM venvs (those of the shape sparkform names them are listed)
    + front_certificate: the front's certificate, read back (None: TLS is off); nginx.conf's
      worker_connections is read too

    Every value read back is checked against the shape sparkform writes it in; one that does
    not match is listed in ``untrusted`` and left out, never used.
    """

    default = Snapshot

    def command(
        self,
        packages: list[str],
        users: list[str],
        paths: list[str],
        markers: list[str],
        units: list[str],
        unit_glob: str,
        models_dir: str,
        pins_dir: str,
        cache_root: str,
        cache_keys_dir: str,
        record_path: str,
        kept_root: str,
        venv_root: str,
        front_certificate: str | None = None,
    ) -> str:
        quoted_paths = " ".join(shlex.quote(p) for p in paths)
        sections = [
            section(
                "packages",
                "dpkg-query -W -f='${Package} ${db:Status-Status}\\n' " + " ".join(shlex.quote(p) for p in packages),
            ),
            section("users", " ; ".join(f"getent passwd {shlex.quote(u)}" for u in users)),
            section("stat", f"stat -c '%F|%a|%U|%G|%n' {quoted_paths}"),
            section("sha256", f"sha256sum {quoted_paths}"),
            section("order_blind", order_blind_command([p for p in paths if fnmatch.fnmatchcase(p, unit_glob)])),
            section("markers", plain_files(" ".join(shlex.quote(m) for m in markers)) if markers else "true"),
            section(
                "units",
                f"systemctl show --timestamp=unix -p {SYSTEMCTL_SHOW_PROPERTIES} "
                + " ".join(shlex.quote(u) for u in units),
            ),
            section("rendered_units", f"grep -l '^# Rendered by sparkform' {unit_glob}"),
            section(
                "unit_files",
                f"systemctl list-unit-files --no-legend --no-pager {shlex.quote(unit_glob.rsplit('/', 1)[-1])}",
            ),
            section("checkpoints", checkpoint_scan_command(models_dir)),
            section("pins", pins_command(pins_dir)),
            section("versions", LIVE_VERSIONS_COMMAND),
            section("record", plain_file(record_path)),
            section("boot", "systemctl show --timestamp=unix -p UserspaceTimestamp --value"),
            section("cache_keys", plain_files(f"{shlex.quote(cache_keys_dir)}/*")),
            section("caches_aside", f"ls -d {shlex.quote(cache_root)}/*{STALE_MARK}*"),
            section(
                "kept",
                plain_files(f"{shlex.quote(kept_root)}/*/{KEPT_RECORD} {shlex.quote(kept_root)}/*/{ROLLBACK_RECORD}"),
            ),
            section("kept_previous", plain_files(f"{shlex.quote(kept_root)}/*/{KEPT_PREVIOUS}/{KEPT_RECORD}")),
            section(
                "venvs",
                f"find {shlex.quote(venv_root)} -mindepth 1 -maxdepth 1 -type d -regextype posix-extended "
                f"-regex {shlex.quote('.*/' + VENV_NAME.pattern)} -printf '%f\\n'",
            ),
            section("worker_connections", f"grep -E '^[[:space:]]*worker_connections' {NGINX_MAIN_CONFIG}"),
        ]
        if front_certificate:
            sections.append(section("front_certificate", read_command(front_certificate)))
        return " ; ".join(sections)

    def process(self, output: list[str]) -> Snapshot:
        sections, links = split_sections(output)
        snapshot = Snapshot()
        snapshot.untrusted.extend(
            f"{path} is a symbolic link: sparkform writes a plain file there, and root follows no link"
            for path in links
        )
        for line in sections.get("packages", []):
            name, _, status = line.partition(" ")
            if status == "installed":
                snapshot.installed_packages.add(name)
        snapshot.users = {
            fields[0]: fields[5]
            for fields in (line.split(":") for line in sections.get("users", []))
            if len(fields) == 7
        }
        digests = {}
        for line in sections.get("sha256", []):
            digest, _, path = line.partition("  ")
            digests[path] = digest
        for line in sections.get("stat", []):
            kind, mode, user, group, path = line.split("|", 4)
            link = kind == "symbolic link"
            snapshot.paths[path] = RemoteFile(
                None if kind == "directory" or link else digests.get(path), mode, user, group, link=link
            )
        untrusted = snapshot.untrusted

        def checked(pattern: re.Pattern, value: str, where: str, what: str) -> bool:
            return shaped((pattern, what), value, where, untrusted)

        for line in sections.get("order_blind", []):
            digest, _, path = line.partition(" ")
            if checked(SHA256, digest, path, "a sha256 digest"):
                snapshot.order_blind[path] = digest
        for line in sections.get("markers", []):
            path, _, content = line.partition(":")
            if checked(STAMP, content, path, "a stamp sparkform writes"):
                snapshot.markers[path] = content
        snapshot.engines = engine_states(sections.get("units", []))
        snapshot.rendered_units = {
            path
            for path in sections.get("rendered_units", [])
            if checked(UNIT_FILE, path.rsplit("/", 1)[-1], path, "a unit file name")
        }
        for line in sections.get("unit_files", []):
            unit, *state = line.split()
            if checked(UNIT_FILE, unit, unit, "a unit file name"):
                snapshot.unit_files[unit] = state[0] if state else ""
        for line in sections.get("checkpoints", []):
            folder, mtime, marker, verdict = line.rsplit("|", 3)
            drift = None if verdict == "-" else [] if verdict == "ok" else verdict.split(",")
            if (
                checked(REPO_AT, folder.rsplit("/", 1)[-1], folder, "a checkpoint folder name (repo@commit)")
                and (not marker or checked(COMMIT_ID, marker, f"{folder}/{COMPLETE_MARKER}", "a commit id"))
                and all(
                    checked(MANIFEST_PATH, path, f"{folder}/{CHECKPOINT_MANIFEST}", "a checkpoint file")
                    for path in drift or []
                )
            ):
                snapshot.checkpoints[folder] = CheckpointFolder(marker or None, drift, float(mtime))
        snapshot.pins = pins(sections.get("pins", []), untrusted)
        snapshot.live_versions = sections.get("versions", [])
        try:
            snapshot.record = HostRecord.from_json("\n".join(sections.get("record", [])))
        except UntrustedValue as err:
            untrusted.append(f"the host record: {err}")
        boot = sections.get("boot", [""])[0] if sections.get("boot") else ""
        snapshot.booted_at = float(boot[1:]) if boot.startswith("@") and boot[1:].isdigit() else None
        snapshot.cache_keys = named_lines(
            sections.get("cache_keys", []),
            (ENGINE_NAME_PATTERN, "a cache key file of an engine"),
            (CACHE_KEY_PATTERN, "a cache key"),
            untrusted,
        )
        for path in sections.get("caches_aside", []):
            if checked(CACHE_KEY_PATTERN, path.rsplit(STALE_MARK, 1)[-1], path, "a cache folder moved aside"):
                snapshot.caches_aside.append(path)
        connections = [WORKER_CONNECTIONS.fullmatch(line) for line in sections.get("worker_connections", [])]
        if len(connections) == 1 and connections[0]:
            snapshot.worker_connections = int(connections[0][1])
        snapshot.front_certificate = read_back(
            sections.get("front_certificate", []), "the front's certificate", untrusted
        )
        snapshot.venvs = [
            name for name in sections.get("venvs", []) if checked(VENV_NAME, name, name, "a venv folder's name")
        ]
        _read_kept(sections.get("kept", []), snapshot, previous=False)
        _read_kept(sections.get("kept_previous", []), snapshot, previous=True)
        return snapshot


def _read_kept(lines: list[str], snapshot: Snapshot, previous: bool) -> None:
    """Each engine's kept settings and rollback record, or (`previous`) the settings kept before
    them, one JSON line each, by the engine's folder; a record of another shape, or one that
    names another engine, is untrusted."""
    readers: dict[str, tuple[Callable[[str], KeptSettings | Rollback], dict[str, Any]]] = (
        {KEPT_RECORD: (KeptSettings.from_json, snapshot.previous)}
        if previous
        else {
            KEPT_RECORD: (KeptSettings.from_json, snapshot.kept),
            ROLLBACK_RECORD: (Rollback.from_json, snapshot.rollbacks),
        }
    )
    for line in lines:
        path, _, text = line.partition(":")
        folder, _, name = path.rpartition("/")
        engine = folder.rsplit("/", 2)[-2 if previous else -1]
        if not shaped((ENGINE_NAME_PATTERN, "an engine name"), engine, path, snapshot.untrusted) or name not in readers:
            continue
        parse, found = readers[name]
        try:
            value = parse(text)
        except UntrustedValue as err:
            snapshot.untrusted.append(f"{path}: {err}")
            continue
        if value.engine != engine:
            snapshot.untrusted.append(f"{path} names engine {value.engine!r}, not {engine!r}")
            continue
        found[engine] = value
