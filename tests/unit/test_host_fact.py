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


def test_a_fresh_host_reads_as_empty():
    snapshot = SparkformHost().process([f"{SECTION}{name}" for name in
                                        ("packages", "users", "stat", "sha256", "markers", "units", "rendered_units")])
    assert (snapshot.installed_packages, snapshot.users, snapshot.paths, snapshot.markers,
            snapshot.engines, snapshot.rendered_units) == (set(), set(), {}, {}, {}, set())


def test_command_is_one_shell_line_that_never_fails_the_host():
    command = SparkformHost().command(packages=["curl"], users=["vllm"], paths=["/etc/a b"],
                                      markers=["/m"], units=["vllm-x.service"],
                                      unit_glob="/etc/systemd/system/vllm-*.service")
    for section in ("packages", "users", "stat", "sha256", "markers", "units", "rendered_units"):
        assert f"echo {SECTION}{section};" in command
    assert "'/etc/a b'" in command  # quoted paths
    # Each section ends in `|| true`: a missing file or unit must not fail the fact.
    assert command.count("|| true") == 7
