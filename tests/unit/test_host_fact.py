"""The deploy's one fact: its command gathers every section, its parser reads them back."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from facts.host import CHECKPOINT_SCAN, SECTION, CheckpointFolder, RemoteFile, SparkformHost

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
{SECTION}sha256
0f1e2d  /etc/systemd/system/vllm-q38.service
aabbcc  /etc/sparkform/secrets/engine.env
{SECTION}markers
/opt/sparkform/venvs/vllm-0.27.1/.sparkform-complete|vllm==0.27.1
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
    snapshot = SparkformHost().process(CAPTURED)
    assert snapshot.installed_packages == {"python3", "curl"}
    assert snapshot.users == {"vllm"}
    assert snapshot.paths["/etc/sparkform"] == RemoteFile(None, "755", "root", "root")
    assert snapshot.paths["/etc/systemd/system/vllm-q38.service"] == RemoteFile("0f1e2d", "644", "root", "root")
    assert snapshot.paths["/etc/sparkform/secrets/engine.env"].group == "vllm"
    assert snapshot.markers == {"/opt/sparkform/venvs/vllm-0.27.1/.sparkform-complete": "vllm==0.27.1"}
    q38 = snapshot.engines["vllm-q38.service"]
    assert (q38.active_state, q38.main_pid, q38.n_restarts, q38.unit_file_state) == ("active", 4242, 2, "enabled")
    assert not snapshot.engines["vllm-nemotron.service"].exists
    assert snapshot.rendered_units == {"/etc/systemd/system/vllm-q38.service", "/etc/systemd/system/vllm-old.service"}
    models = "/var/lib/sparkform/models"
    assert snapshot.checkpoints == {
        f"{models}/a--b@{'1' * 40}": CheckpointFolder("1" * 40, [], 1700000000.5),
        f"{models}/c--d@{'2' * 40}": CheckpointFolder("2" * 40, ["model-00001.safetensors", "config.json"], 1700000001.0),
        f"{models}/c--d@{'3' * 40}": CheckpointFolder(None, None, 1700000002.0),  # unfinished, no manifest
    }
    assert snapshot.pins == {"a--b@main": "1" * 40, "c--d@v1.0": "2" * 40}


def test_checkpoint_scan_trusts_size_and_mtime_only(tmp_path):
    """The no-op check: an intact checkpoint reads ok without hashing; a truncated or touched
    file is named; an unfinished folder has no marker and no manifest."""
    folder = tmp_path / "o--ckpt@c1"
    folder.mkdir()
    (folder / ".sparkform-complete").write_text("c1\n")
    entries = []
    for name in ("a.safetensors", "b.safetensors"):
        (folder / name).write_bytes(b"x" * 100)
        entries.append({"path": name, "size": 100, "sha256": "not-checked", "mtime": (folder / name).stat().st_mtime})
    (folder / ".sparkform-manifest.json").write_text(json.dumps({"files": entries}))
    bare = tmp_path / "o--ckpt@c2"
    bare.mkdir()
    (tmp_path / ".pins").mkdir()  # no @ in its name: not a checkpoint

    def check() -> dict[str, tuple[str, str]]:
        out = subprocess.run([sys.executable, "-c", CHECKPOINT_SCAN, str(tmp_path)],
                             capture_output=True, text=True, check=True).stdout
        return {folder: (marker, verdict) for folder, _, marker, verdict in
                (line.split("|") for line in out.splitlines())}

    # "not-checked" sha256: nothing was hashed
    assert check() == {str(folder): ("c1", "ok"), str(bare): ("", "-")}
    (folder / "b.safetensors").write_bytes(b"x" * 50)
    assert check()[str(folder)] == ("c1", "b.safetensors")


def test_a_fresh_host_reads_as_empty():
    snapshot = SparkformHost().process([f"{SECTION}{name}" for name in
                                        ("packages", "users", "stat", "sha256", "markers", "units", "rendered_units",
                                                     "checkpoints", "pins")])
    assert (snapshot.installed_packages, snapshot.users, snapshot.paths, snapshot.markers, snapshot.engines,
            snapshot.rendered_units, snapshot.checkpoints, snapshot.pins) == (set(), set(), {}, {}, {}, set(), {}, {})


def test_command_is_one_shell_line_that_never_fails_the_host():
    command = SparkformHost().command(packages=["curl"], users=["vllm"], paths=["/etc/a b"],
                                      markers=["/m"], units=["vllm-x.service"],
                                      unit_glob="/etc/systemd/system/vllm-*.service", models_dir="/m d",
                                      pins_dir="/m d/.pins", cache_root="/c", record_path="/r/host-record.json")
    sections = ("packages", "users", "stat", "sha256", "markers", "units", "rendered_units", "unit_files",
                "checkpoints", "pins", "versions", "record", "boot", "cache_keys", "caches_aside")
    for section in sections:
        assert f"echo {SECTION}{section};" in command
    assert "'/etc/a b'" in command  # quoted paths
    # Each section ends in `|| true`: a missing file or unit must not fail the fact.
    assert command.count("|| true") == len(sections)


@pytest.mark.parametrize("line, booted_at", [("@1764412345", 1764412345.0), ("", None), ("n/a", None),
                                             ("@17644$(id)", None)])
def test_boot_time_is_systemds_start_and_only_a_number_is_taken(line, booted_at):
    assert SparkformHost().process([f"{SECTION}boot", line]).booted_at == booted_at
