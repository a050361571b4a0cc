"""One deploy at a time per host: the host lock, a kernel lock (flock) on a file in a root-only
folder (HostPaths.host_lock; its holder's line beside it, `lock.holder`).

Whatever changes the host as a whole takes it before its first change and holds it to its last:
a deploy (and so `sparkform rebuild`), `sparkform rollback`, the scrub's repair. A second one
waits a bounded time, told who holds it (the holder's own line: what, from where, since when),
then is refused. The kernel frees a lock whose process died, so no lock outlives its run:

- a deploy's holder is this module run as `python3 -I -c SOURCE hold WAIT_S LOCK WHAT` over
  the deploy's own SSH connection (the host may not have sparkform yet), with the deploy on its
  stdin. It holds the lock until its stdin ends (the deploy ended, or its connection did) or
  stays silent for HOLDER_SILENCE_S (a laptop gone without a word: its beats stop,
  sparkform/deploy/operations/hostlock.py);
- `run WAIT_S LOCK WHAT -- COMMAND...` holds it for one command (the rollback), whose stdin it
  passes on;
- the scrub takes it in-process (held).

Exit codes of `hold` and `run`: 0 done (for `run`, the command's own code otherwise); 4 refused,
another run held the lock for the whole wait; 2 usage.
"""

import contextlib
import fcntl
import os
import re
import select
import subprocess
import sys
import time

HOLDER_SILENCE_S = 120  # a deploy beats every 20 s (sparkform/deploy/operations/hostlock.py)
EXIT_REFUSED = 4
EXIT_USAGE = 2
# A holder's line as it is written and read back: printable ASCII, bounded.
HOLDER_LINE = re.compile(r"[ -~]{1,300}")


def printable(text):
    """The text as one holder line: printable ASCII only, at most 300 characters."""
    line = re.sub(r"[^ -~]", "?", text)[:300]
    return line if HOLDER_LINE.fullmatch(line) else "?"


def holder(lock):
    """The line the lock's holder wrote ("unknown" when there is none of the expected shape)."""
    try:
        fd = os.open(f"{lock}.holder", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return "unknown"
    with os.fdopen(fd, "rb") as handle:
        line = handle.read(400).decode("ascii", "replace").strip()
    return line if HOLDER_LINE.fullmatch(line) else "unknown"


def taken(wait_s, lock, waiting):
    """The lock's file descriptor once this process holds the lock, or None when another held it
    for the whole wait; `waiting(holder line)` is called once, when it is held at first. Its
    folder is made (root's alone) on a host that has none yet."""
    os.makedirs(os.path.dirname(lock), mode=0o700, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    deadline = time.monotonic() + wait_s
    told = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                return None
            if not told:
                waiting(holder(lock))
                told = True
            time.sleep(1)


def claim(lock, what):
    """Write the holder's line (what, since when), replaced whole, root-only."""
    line = printable(f"{what} since {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
    partial = f"{lock}.holder.{os.getpid()}"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as handle:
        handle.write(line + "\n")
    os.replace(partial, f"{lock}.holder")


@contextlib.contextmanager
def held(wait_s, lock, what, waiting):
    """The lock held for the block (True), or not taken: another run held it for the whole wait
    (False, and the block should change nothing)."""
    fd = taken(wait_s, lock, waiting)
    if fd is None:
        yield False
        return
    try:
        claim(lock, what)
        yield True
    finally:
        os.close(fd)


def say(line):
    print(line, flush=True)


def hold(wait_s, lock, what):
    """A deploy's holder: 'waiting HOLDER', then 'locked' or 'refused HOLDER' on stdout; holds the
    lock until stdin ends or stays silent HOLDER_SILENCE_S."""
    with held(wait_s, lock, what, lambda line: say(f"waiting {line}")) as locked:
        if not locked:
            say(f"refused {holder(lock)}")
            return EXIT_REFUSED
        say("locked")
        while select.select([sys.stdin], [], [], HOLDER_SILENCE_S)[0]:
            if not os.read(sys.stdin.fileno(), 4096):
                break
    return 0


def run(wait_s, lock, what, command):
    """One command with the lock held; the waiting and a refusal on stderr."""
    with held(wait_s, lock, what, lambda line: print(f"sparkform: waiting for {line}", file=sys.stderr)) as locked:
        if not locked:
            print(f"sparkform: refused: the host is held by {holder(lock)}", file=sys.stderr)
            return EXIT_REFUSED
        return subprocess.run(command, check=False).returncode


def main(argv):
    if len(argv) == 4 and argv[0] == "hold" and argv[1].isdigit() and os.path.isabs(argv[2]):
        return hold(int(argv[1]), argv[2], argv[3])
    if len(argv) >= 6 and argv[0] == "run" and argv[1].isdigit() and os.path.isabs(argv[2]) and argv[4] == "--":
        return run(int(argv[1]), argv[2], argv[3], argv[5:])
    print("usage: hostlock hold WAIT_S LOCK WHAT | run WAIT_S LOCK WHAT -- COMMAND...", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
