"""The guard's watch over an engine's start, from its exec to readiness (the unit "activating"):
the readiness budget is only the outer bound. A start with a stopped process (SIGSTOP, a
debugger) for STOPPED_S, or with no progress for the inventory's start_stall_s, is failed:
killed, so systemd starts it again and counts a start that never served. Progress is a new line
in the unit's journal, or the unit's processes using at least PROGRESS_CPU_SHARE of a CPU since
the last progress (loading weights, compiling and capturing graphs all burn CPU; a start that
waits on something that never comes does not). On a starved machine (CPU, IO or memory pressure)
a quiet start is not evidence of a stall either: it waits up to STARVED_STALLS x start_stall_s.
Three hosts sharing two cores can keep a healthy start silent for 90 s under 10 % of a CPU;
judged by start_stall_s alone it is killed, and the deploy that started it fails. The time an
engine waits its turn behind a loading neighbour (its launch state "waiting") is not the start's
to judge."""

import os
import re
import stat

STOPPED_S = 10
PROGRESS_CPU_SHARE = 0.1
STARVED_STALLS = 3
LAUNCH_STATE = re.compile(r"(waiting|loading)( [a-z0-9][a-z0-9-]{0,39})?")


class StartJudge:
    """One start's verdict, sample by sample: "starts", "starved" (quiet past the bound on a
    starved machine: it waits on), "stopped" or "stalled". `told_starved`: whether the guard
    journaled this quiet spell's starvation (once a spell)."""

    def __init__(self, stall_s, stopped_s=STOPPED_S):
        self.stall_s, self.stopped_s = stall_s, stopped_s
        self.forget()

    def forget(self):
        """A fresh watch: a new start, or one that is waiting its turn."""
        self.progress_at = self.cursor = self.cpu = self.stopped_since = None
        self.told_starved = False

    def judge(self, now, stopped, cursor, cpu, starved=lambda: False):
        """`stopped`: the unit has a stopped process; `cursor`: its journal's latest entry;
        `cpu`: its processes' CPU seconds (None: unreadable, which proves no progress);
        `starved()`: whether the machine is starved now (asked only of a start quiet too long)."""
        if not stopped:
            self.stopped_since = None
        elif self.stopped_since is None:
            self.stopped_since = now
        elif now - self.stopped_since >= self.stopped_s:
            return "stopped"
        if self.progress_at is None:
            self.progress_at, self.cursor, self.cpu = now, cursor, cpu
            return "starts"
        burned = (
            cpu is not None and self.cpu is not None and cpu - self.cpu >= PROGRESS_CPU_SHARE * (now - self.progress_at)
        )
        if cursor != self.cursor or burned:
            self.progress_at, self.cursor, self.cpu = now, cursor, cpu
            self.told_starved = False
            return "starts"
        quiet = now - self.progress_at
        if quiet < self.stall_s:
            return "starts"
        return "starved" if quiet < STARVED_STALLS * self.stall_s and starved() else "stalled"

    def quiet_s(self, now):
        return 0 if self.progress_at is None else now - self.progress_at


def launch_state(lock_dir, engine):
    """What the engine's launch said of itself ("waiting OTHER", "loading"; "" unknown). The
    engine user writes that file: read without following a link, a plain file only (a FIFO there
    would block or fail the read), bounded, by pattern."""
    try:
        fd = os.open(os.path.join(lock_dir, f"{engine}.state"), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        text = os.read(fd, 64).decode("ascii", "replace").strip()
    except OSError:
        return ""
    finally:
        os.close(fd)
    return text if LAUNCH_STATE.fullmatch(text) else ""
