"""The host lock, from the deploy's side: taken before the deploy reads the host (so its plan is
made on what the run before it left), held over the deploy's own SSH connection to its end.

The holder on the host (sparkform/host/hostlock.py `hold`) runs in a session of its own on that
connection, with this run's beats on its stdin: it lets go when the run ends (its connection
closes), when the connection is cut, or when the beats stop for HOLDER_SILENCE_S (a laptop gone
without a word). A second run waits `host_lock_wait_s`, saying who holds the host, then stops
with exit 4 before it reads or changes anything. Every pyinfra run of the deploy takes it, a dry
run too (a dry run read beside a deploy would show a host in change).

A run cut by Ctrl-C exits 130 (pyinfra's own handler exits 0: "Exiting upon user request!").
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import NoReturn

from pyinfra import host, logger

from sparkform.domain.schema import HostConfig
from sparkform.host.hostlock import EXIT_REFUSED, HOLDER_LINE
from sparkform.writers.programs import host_lock_command, run_by

BEAT_S = 20  # well inside the holder's HOLDER_SILENCE_S
EXIT_CUT = 130
HELD: dict[str, Holder] = {}  # host name -> its holder, kept for the whole run


def what_runs() -> str:
    """This run's command as the holder's line names it: its files, never a --data value
    (`sparkform rebuild` names itself in SPARKFORM_COMMAND)."""
    return os.environ.get("SPARKFORM_COMMAND") or " ".join(
        ["pyinfra", *(word for word in sys.argv[1:] if word.endswith(".py") or word == "--dry")]
    )


def cut(signum: int, frame: object) -> None:
    sys.stderr.write("\nsparkform: the run was cut (Ctrl-C) before its last operation: exit 130\n")
    sys.stderr.flush()
    os._exit(EXIT_CUT)


class Holder:
    """The holder's process on the host: over the deploy's own SSH transport (a session of its
    own), or a child of this process for pyinfra's @local connector (a deploy run on the Spark)."""

    def __init__(self, command: str) -> None:
        client = getattr(host.connector, "client", None)
        if client is not None:
            self.channel = client.get_transport().open_session()
            self.channel.exec_command(command)
            self.lines, self.process = self.channel.makefile("r"), None
        elif type(host.connector).__name__ == "LocalConnector":
            self.channel = None
            self.process = subprocess.Popen(
                ["bash", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            self.lines = self.process.stdout
        else:
            refused(f"the host lock needs pyinfra's ssh or local connector, not {type(host.connector).__name__}")

    def beat(self) -> bool:
        """One newline to the holder; False once it is gone."""
        try:
            if self.channel is not None:
                self.channel.sendall(b"\n")
            elif self.process is not None and self.process.stdin is not None:
                self.process.stdin.write(b"\n")
                self.process.stdin.flush()
        except OSError:
            return False
        return True

    def why_it_ended(self) -> str:
        """The holder's exit code and last lines of stderr, once it ended without taking the lock."""
        if self.channel is not None:
            code, err = self.channel.recv_exit_status(), self.channel.makefile_stderr("r").read()
        else:
            assert self.process is not None and self.process.stderr is not None  # a local holder: stderr piped
            code, err = self.process.wait(), self.process.stderr.read()
        lines = err.decode("utf-8", "replace").strip().splitlines()[-3:]
        return f"exit {code}: {' / '.join(lines) or 'no output'}"


def beats(holder: Holder) -> None:
    """A newline to the holder every BEAT_S, until it is gone."""
    while holder.beat():
        time.sleep(BEAT_S)


def refused(line: str) -> NoReturn:
    logger.error(f"[{host.name}] {line}")
    raise SystemExit(EXIT_REFUSED)


def after_the_hosts_before(wait_s: int) -> None:
    """pyinfra prepares its hosts side by side: each takes its lock only once this run holds those
    of the hosts before it in the inventory, so two runs of one inventory take them in one order
    and never wait for each other crosswise (bounded all the same)."""
    state = host.state
    hosts = list(state.inventory)
    before = [h.name for h in hosts[: hosts.index(host)] if h in state.active_hosts]
    deadline = time.monotonic() + wait_s + 60
    while not all(name in HELD for name in before) and time.monotonic() < deadline:
        time.sleep(0.2)  # gevent's: the other hosts' greenlets run meanwhile


def host_locked(config: HostConfig) -> None:
    """Hold the host lock for the rest of this run (once per host); exit 4 when refused."""
    if host.name in HELD:
        return
    after_the_hosts_before(config.host_lock_wait_s)
    signal.signal(signal.SIGINT, cut)  # in place of pyinfra's, which exits 0
    holder = Holder(host_lock_command(config, run_by(what_runs()), bool(host.data.get("_sudo"))))
    for raw in holder.lines:
        text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else raw
        kind, _, line = text.strip().partition(" ")
        line = line if HOLDER_LINE.fullmatch(line) else "a run whose line is unreadable"
        if kind == "locked":
            HELD[host.name] = holder
            threading.Thread(target=beats, args=(holder,), daemon=True).start()
            return
        if kind == "waiting":
            logger.warning(
                f"[{host.name}] another run holds this host: {line}; waiting for it "
                f"(at most host_lock_wait_s, {config.host_lock_wait_s} s)"
            )
        elif kind == "refused":
            refused(
                f"another run held this host for the whole wait (host_lock_wait_s, {config.host_lock_wait_s} s): "
                f"{line}. Nothing was read or changed: run again once it ended (exit 4)"
            )
    refused(
        f"could not take the host lock ({holder.why_it_ended()}). The deploy needs root's /usr/bin/python3 on "
        "the host (and `sudo -n` without a password when _sudo is set)"
    )
