"""sparkform-rollback ENGINE [--by deploy|hand] (run as root by the system's python3): put ENGINE
back on the settings it last served with, which the deploy keeps in KEPT_ROOT/ENGINE/ once the
engine served them (copies of its unit, env and args files, and kept.json: when, the venv and
checkpoint folder, their digest), or, when it runs those (a change that served but misbehaves),
on the ones kept before them (ENGINE/previous/, which then trade places with the last ones). The
host's engines, KEPT_ROOT and the guard come from the settings file beside it,
sparkform-rollback.json. The deploy runs it when a changed engine's start failed, with the
journal's why-lines on stdin; `sparkform rollback` runs it by hand (--by hand, the reason on
stdin). It writes the kept files back, records why in rolled-back.json beside them (the next
deploy's dry-run names it), tells a human through the guard's alert (event rolled-back), stops
the engine, reloads systemd and starts it to readiness (the readiness helper holds `systemctl
start` until it serves), then the engines target again when it is enabled (it stopped with the
engine). The other engines are not touched.

Exit codes:
  0  back on its kept settings, and serving
  2  usage, or an engine this host does not run
  3  nothing to go back to: no kept settings, kept settings that are not what the deploy wrote
     (owner, mode, shape, digest), their venv or checkpoint folder is not complete any more, or
     the engine runs them and none were kept before them; nothing was changed
  4  the kept settings are back, but the engine's start on them failed too
"""

import json
import os
import re
import stat
import subprocess
import sys
import tempfile
import time

from sparkform.host import ROOT_PYTHON, RollbackSettings, program_path, settings_path
from sparkform.host.folders import COMPLETE_MARKER, CONTROL
from sparkform.host.kept import KEPT_FILES, KEPT_PREVIOUS, KEPT_RECORD, ROLLBACK_RECORD, day, settings_digest
from sparkform.host.systemd import why_a_start_failed
from sparkform.host.whole_files import replaced

DIGEST = re.compile(r"[0-9a-f]{32}")
PATH = re.compile(r"(/[A-Za-z0-9._+@-]+)+")
REASON_MAX = 1000


class NothingToGoBackTo(Exception):
    pass


START_TRIES = 2


def root_only(path, folder):
    """`path` is root's, not a link, and (a folder) nobody else's to write or read."""
    info = os.lstat(path)
    kind = stat.S_ISDIR(info.st_mode) if folder else stat.S_ISREG(info.st_mode)
    if not kind or info.st_uid != 0 or info.st_mode & 0o077:
        raise NothingToGoBackTo(f"{path} is not root's alone")


def read(path):
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def kept_settings(folder, engine):
    """(kept.json's values, the kept texts in KEPT_FILES order) of a kept folder, each checked;
    None when the folder is not there."""
    try:
        root_only(folder, folder=True)
        record = json.loads(read(os.path.join(folder, KEPT_RECORD)))
        texts = []
        for name in KEPT_FILES:
            path = os.path.join(folder, name)
            root_only(path, folder=False)
            texts.append(read(path))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise NothingToGoBackTo(f"the kept settings in {folder} cannot be read: {err}") from None
    if not (
        isinstance(record, dict)
        and record.get("engine") == engine
        and isinstance(record.get("since"), int)
        and all(isinstance(record.get(key), str) and PATH.fullmatch(record[key]) for key in ("venv", "checkpoint"))
        and isinstance(record.get("digest"), str)
        and DIGEST.fullmatch(record["digest"])
    ):
        raise NothingToGoBackTo(f"{os.path.join(folder, KEPT_RECORD)} is not what the deploy writes")
    if settings_digest(texts) != record["digest"]:
        raise NothingToGoBackTo(f"the kept files in {folder} are not those its {KEPT_RECORD} describes")
    return record, texts


def settings_to_go_back_to(kept_root, engine, running):
    """(folder, kept.json's values, texts): the last serving settings, or, when the engine runs
    those (`running`: their digest), the ones kept before them; each checked, venv and
    checkpoint still complete."""
    folder = os.path.join(kept_root, engine)
    last = kept_settings(folder, engine)
    if last is None:
        raise NothingToGoBackTo(f"{engine} has no kept settings yet (none served since sparkform keeps them)")
    chosen = folder
    if last[0]["digest"] == running:
        chosen = os.path.join(folder, KEPT_PREVIOUS)
        last = kept_settings(chosen, engine)
        if last is None or last[0]["digest"] == running:
            raise NothingToGoBackTo(f"{engine} already runs its last serving settings, and none were kept before them")
    record, texts = last
    for key in ("venv", "checkpoint"):
        if not os.path.isfile(os.path.join(record[key], COMPLETE_MARKER)):
            raise NothingToGoBackTo(f"the kept settings' {key} {record[key]} is not complete any more")
    return chosen, record, texts


def swapped(folder):
    """The settings kept before the last ones become the last (the engine serves them now), and
    the last the ones before."""
    previous = os.path.join(folder, KEPT_PREVIOUS)
    staging = tempfile.mkdtemp(dir=folder, prefix=".swap.")
    for name in (*KEPT_FILES, KEPT_RECORD):
        os.rename(os.path.join(folder, name), os.path.join(staging, name))
        os.rename(os.path.join(previous, name), os.path.join(folder, name))
    os.rmdir(previous)
    os.rename(staging, previous)


def current_texts(files):
    texts = []
    for path in files:
        try:
            texts.append(read(path))
        except (OSError, UnicodeDecodeError):
            texts.append("")
    return texts


def reason_of(lines, by):
    """The why-lines as one printable line (they come from the engine's journal)."""
    text = "; ".join(line.strip() for line in lines if line.strip())
    text = CONTROL.sub(" ", text)[:REASON_MAX]
    return text or ("its start failed" if by == "deploy" else "by hand")


def why_lines():
    """The lines on stdin (none from a terminal), bounded; bytes that are not UTF-8 replaced
    (they come from the engine's journal)."""
    if sys.stdin.isatty():
        return []
    return sys.stdin.buffer.read(64 * 1024).decode("utf-8", "replace").splitlines()


def systemctl(*args):
    return subprocess.run(["systemctl", *args], check=False).returncode == 0


def started_on_kept_settings(unit):
    """Start `unit` on settings that served before, up to START_TRIES times: a start those settings
    fail once (the machine short of memory a moment, the engine killed while it loads) is not yet
    theirs to blame. After each failed try, why, from its journal, as the deploy shows it."""
    for attempt in range(1, START_TRIES + 1):
        systemctl("reset-failed", unit)
        since = time.time()
        if systemctl("start", unit):
            return True
        again = "trying once more" if attempt < START_TRIES else "giving up"
        print(
            f"sparkform-rollback: {unit} failed to start on its kept settings (try {attempt} of {START_TRIES}, "
            f"{again}); its journal (all of it: journalctl -u {unit}):",
            *(CONTROL.sub(" ", line) for line in why_a_start_failed(unit, since)),
            sep="\n",
            file=sys.stderr,
            flush=True,
        )
    return False


def roll_back(settings: RollbackSettings, engine, by, lines):
    """Put `engine` back (settings: the file beside this program, as the deploy rendered it)."""
    unit, files = settings["engines"][engine]["unit"], settings["engines"][engine]["files"]
    kept = os.path.join(settings["kept_root"], engine)
    failed = settings_digest(current_texts(files))
    chosen, record, texts = settings_to_go_back_to(settings["kept_root"], engine, failed)
    reason = reason_of(lines, by)
    # The record first: whatever the start below does, the next dry-run knows why the engine's
    # files are not the inventory's.
    replaced(
        os.path.join(kept, ROLLBACK_RECORD),
        json.dumps(
            {"engine": engine, "at": round(time.time()), "by": by, "reason": reason, "failed": failed}, sort_keys=True
        )
        + "\n",
        0o600,
    )
    if chosen != kept:
        swapped(kept)
    for path, text in zip(files, texts, strict=True):
        replaced(path, text, 0o644)
    back_to = f"its settings of {day(record['since'])} (venv {record['venv']}, checkpoint {record['checkpoint']})"
    subprocess.run(
        [
            *ROOT_PYTHON,
            settings["guard"],
            "alert",
            "rolled-back",
            engine,
            f"{unit} {'failed to start' if by == 'deploy' else 'was rolled back by hand'}: {reason}; back on {back_to}",
        ],
        check=False,
    )
    print(f"sparkform-rollback: {engine} goes back to {back_to}", flush=True)
    # Stopped first: after a failed start systemd would start it again on the files that failed
    # (Restart=always) while they are being replaced.
    systemctl("stop", unit)
    systemctl("daemon-reload")
    if not started_on_kept_settings(unit):
        return 4
    # The target stopped with the engine (it is Requisite= of the engines); the deploy would start
    # it again, so does this: it waits for nothing once the engines serve.
    if systemctl("is-enabled", "--quiet", settings["target"]):
        systemctl("start", settings["target"])
    print(
        f"sparkform-rollback: {engine} serves again on {back_to}\n"
        f"sparkform-rollback: the settings it left: {reason}\n"
        "sparkform-rollback: to retry, change them in the inventory and deploy again "
        "(until then a dry-run names them)",
        flush=True,
    )
    return 0


def main(argv) -> int:
    by = "deploy"
    if len(argv) == 3 and argv[1] == "--by" and argv[2] in ("deploy", "hand"):
        by = argv[2]
    elif len(argv) != 1:
        print("usage: sparkform-rollback ENGINE [--by deploy|hand] (the reason on stdin)", file=sys.stderr)
        return 2
    try:
        with open(settings_path(program_path())) as handle:
            settings: RollbackSettings = json.load(handle)
    except (OSError, ValueError) as err:
        print(f"sparkform-rollback: cannot read its settings: {err}", file=sys.stderr)
        return 2
    engine = argv[0]
    if engine not in settings["engines"]:
        print(
            f"sparkform-rollback: this host runs no engine {engine!r} ({', '.join(settings['engines'])})",
            file=sys.stderr,
        )
        return 2
    try:
        return roll_back(settings, engine, by, why_lines())
    except NothingToGoBackTo as err:
        print(f"sparkform-rollback: {err}; nothing was changed", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
