"""The deploy's one fact: its command gathers every section, its parser reads them back."""

from __future__ import annotations

from facts.host import SECTION, RemoteFile, SparkformHost

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
{SECTION}manifests
/var/lib/sparkform/models/a--b@main|ok
/var/lib/sparkform/models/c--d@main|model-00001.safetensors,config.json
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
    assert snapshot.checkpoint_drift == {"/var/lib/sparkform/models/a--b@main": [],
                                         "/var/lib/sparkform/models/c--d@main": ["model-00001.safetensors", "config.json"]}


def test_manifest_check_trusts_size_and_mtime_only(tmp_path):
    """The no-op check: an intact checkpoint reads ok without hashing; a truncated or touched
    file is named."""
    import json
    import subprocess
    import sys

    from facts.host import MANIFEST_CHECK

    folder = tmp_path / "ckpt"
    folder.mkdir()
    entries = []
    for name in ("a.safetensors", "b.safetensors"):
        (folder / name).write_bytes(b"x" * 100)
        entries.append({"path": name, "size": 100, "sha256": "not-checked", "mtime": (folder / name).stat().st_mtime})
    (folder / ".sparkform-manifest.json").write_text(json.dumps({"files": entries}))
    bare = tmp_path / "no-manifest"
    bare.mkdir()

    def check() -> str:
        return subprocess.run([sys.executable, "-c", MANIFEST_CHECK, str(folder), str(bare)],
                              capture_output=True, text=True, check=True).stdout

    assert check() == f"{folder}|ok\n"  # "not-checked" sha256: nothing was hashed
    (folder / "b.safetensors").write_bytes(b"x" * 50)
    assert check() == f"{folder}|b.safetensors\n"


def test_a_fresh_host_reads_as_empty():
    snapshot = SparkformHost().process([f"{SECTION}{name}" for name in
                                        ("packages", "users", "stat", "sha256", "markers", "units", "rendered_units",
                                                     "manifests")])
    assert (snapshot.installed_packages, snapshot.users, snapshot.paths, snapshot.markers,
            snapshot.engines, snapshot.rendered_units, snapshot.checkpoint_drift) == (set(), set(), {}, {}, {}, set(), {})


def test_command_is_one_shell_line_that_never_fails_the_host():
    command = SparkformHost().command(packages=["curl"], users=["vllm"], paths=["/etc/a b"],
                                      markers=["/m"], units=["vllm-x.service"],
                                      unit_glob="/etc/systemd/system/vllm-*.service", checkpoints=["/c"])
    for section in ("packages", "users", "stat", "sha256", "markers", "units", "rendered_units", "manifests"):
        assert f"echo {SECTION}{section};" in command
    assert "'/etc/a b'" in command  # quoted paths
    # Each section ends in `|| true`: a missing file or unit must not fail the fact.
    assert command.count("|| true") == 8
