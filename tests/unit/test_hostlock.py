"""The host lock (sparkform/host/hostlock.py) in real processes, as the deploy, the rollback and the
scrub take it: on a lock file in tmp_path, with this machine's python3 -I."""

from __future__ import annotations

import subprocess
import sys
import time

from sparkform.domain.schema import HostConfig
from sparkform.host import ROOT_PYTHON, hostlock
from sparkform.writers.programs import host_lock_command, host_locked, host_source

SOURCE = host_source("hostlock")


def holder(lock, what: str, silence_s: float | None = None) -> subprocess.Popen:
    """A deploy's holder (`hold`), its stdin the deploy's beats; with silence_s, a holder that lets
    go after that much silence instead of HOLDER_SILENCE_S."""
    source = (
        SOURCE if silence_s is None else SOURCE.replace("HOLDER_SILENCE_S = 120", f"HOLDER_SILENCE_S = {silence_s}")
    )
    return subprocess.Popen(
        [*ROOT_PYTHON, "-c", source, "hold", "0", str(lock), what],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def waiter(lock, wait_s: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*ROOT_PYTHON, "-c", SOURCE, "hold", str(wait_s), str(lock), "the second"],
        input="",
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_second_run_is_told_the_holder_then_refused_and_lock_ends_with_run(tmp_path):
    lock = tmp_path / "state" / "hostlock" / "lock"
    first = holder(lock, "pyinfra inventory/spark.py deploy.py by owner@laptop (pid 7)")
    assert first.stdout.readline() == "locked\n"
    assert (lock.parent.stat().st_mode & 0o777, lock.stat().st_mode & 0o777) == (0o700, 0o600)
    started = time.monotonic()
    second = waiter(lock, 2)
    assert second.returncode == hostlock.EXIT_REFUSED and time.monotonic() - started >= 2
    (waiting, refused) = second.stdout.splitlines()
    assert waiting.startswith("waiting pyinfra inventory/spark.py deploy.py by owner@laptop (pid 7) since 20"), waiting
    assert refused == f"refused {waiting.removeprefix('waiting ')}"
    # The deploy ended: its connection closed the holder's stdin.
    first.stdin.close()
    assert first.wait(10) == 0
    third = waiter(lock, 0)
    assert (third.returncode, third.stdout) == (0, "locked\n")


def test_a_holder_whose_run_went_silent_lets_go_and_a_waiter_takes_over(tmp_path):
    lock = tmp_path / "lock"
    gone = holder(lock, "a laptop that went away", silence_s=2)
    assert gone.stdout.readline() == "locked\n"
    gone.stdin.write("\n")  # one beat, then none
    gone.stdin.flush()
    taken = waiter(lock, 30)
    assert taken.returncode == 0 and taken.stdout.splitlines()[-1] == "locked", taken.stdout
    assert gone.wait(10) == 0


def test_rollback_holds_lock_passes_stdin_and_exit_refused_during_deploy(tmp_path):
    config = HostConfig(state_dir=str(tmp_path / "state"), host_lock_wait_s=1)
    echo = f"{sys.executable} -c 'import sys; print(sys.stdin.read().upper()); sys.exit(3)'"
    command = f"printf reason | {host_locked(config, 'sparkform rollback of q38', echo)}"
    ran = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
    assert (ran.returncode, ran.stdout) == (3, "REASON\n"), ran.stderr
    deploy = holder(config.paths.host_lock, "a deploy")
    try:
        assert deploy.stdout.readline() == "locked\n"
        refused = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
        assert refused.returncode == hostlock.EXIT_REFUSED and refused.stdout == ""
        assert "sparkform: refused: the host is held by a deploy since" in refused.stderr, refused.stderr
    finally:
        deploy.stdin.close()
        deploy.wait(10)


def test_the_deploys_own_line_holds_the_lock_in_a_real_shell(tmp_path):
    config = HostConfig(state_dir=str(tmp_path / "state"))
    line = host_lock_command(config, "pyinfra x.py by me@here\n$(touch pwned) (pid 1)", sudo=False)
    deploy = subprocess.Popen(
        ["bash", "-c", line], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        assert deploy.stdout.readline() == "locked\n"
        assert not (tmp_path / "pwned").exists()
        assert hostlock.holder(config.paths.host_lock).startswith(
            "pyinfra x.py by me@here?$(touch pwned) (pid 1) since "
        )
    finally:
        deploy.stdin.close()
        assert deploy.wait(10) == 0
    assert host_lock_command(config, "x", sudo=True).startswith("sudo -n /usr/bin/python3 -I -c ")


def test_a_holder_line_of_another_shape_reads_unknown(tmp_path):
    lock = tmp_path / "lock"
    (tmp_path / "lock.holder").write_bytes(b"\x1b]0;evil\x07 since then\n")
    assert hostlock.holder(str(lock)) == "unknown"
    (tmp_path / "lock.holder").write_text("x" * 301 + "\n")
    assert hostlock.holder(str(lock)) == "unknown"
    assert hostlock.printable("a\tb\x1b") == "a?b?"
    assert hostlock.main(["hold", "x", "/tmp/l", "w"]) == hostlock.EXIT_USAGE
    assert hostlock.main(["hold", "1", "relative/lock", "w"]) == hostlock.EXIT_USAGE
