"""sparkform-scrub [--check-only | --retry] [--rate-mib-s R] (run as root by the system's python3): re-hash
every file of the checkpoints the engines serve against the manifest written when it was
verified, reading no faster than the config's rate_mib_s (sparkform-scrub.service runs it at
idle I/O priority, from sparkform-scrub.timer). Everything it knows is in the settings file
beside it, sparkform-scrub.json (rendered from the inventory).

A deploy trusts a file whose size and mtime are as its manifest recorded; bit rot, a bad sector
or a write that kept both are found only here. A checkpoint with a file that no longer matches
(or a manifest that no longer reads) is, in this order:
  1. reported: a line here, and an alert through sparkform-guard for each engine that serves it
     (event checkpoint-corrupt: the journal with the guard's MESSAGE_ID, the webhook, the
     command, the metric);
  2. marked unfinished (its completion marker removed): no engine starts on it meanwhile;
  3. fetched again, as a deploy fetches it (sparkform-checkpoint hashes every file, fetches
     what differs from the hub's tree, and writes the manifest and the marker last);
  4. served again: each engine that serves it and runs is restarted (systemctl try-restart,
     one at a time), so it no longer holds the bad bytes; an alert (checkpoint-repaired) says so.
A repair whose fetch failed (the hub did not answer, another run held the host) is tried again
after retry_s, then twice as long each time up to retry_max_s (a transient timer,
sparkform-scrub-retry-N, runs `sparkform-scrub --retry`); its first failure is alerted once
(checkpoint-repair-failed), its success too (checkpoint-repaired, with the failed tries), and
its engines start on it then: restarted if they run, started again if their refused starts
spent their start limit. Any other checkpoint not complete at its commit is left to the next
deploy.

--check-only reports and changes nothing (`sparkform verify --deep` runs it so, with a rate of its own).

Exit codes:
  0  every complete checkpoint matched its manifest, or was fetched again and serves
  1  a file did not match (--check-only), or fetching it again failed: its marker stays absent,
     so no engine starts on it until a retry (or a deploy) fetches it (the engines keep what
     they loaded)
  2  usage, or an unreadable config
"""

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from sparkform.host import ROOT_PYTHON, ScrubSettings, ServedCheckpoint, hostlock, program_path, settings_path
from sparkform.host.alerts import read_json, write_json
from sparkform.host.folders import COMPLETE_MARKER as MARKER
from sparkform.host.folders import MANIFEST, relative_file
from sparkform.host.systemd import active_state, doubled_pause, run_later, started_afresh, systemctl

CHUNK = 8 * 1024 * 1024
SHA256 = re.compile(r"[0-9a-f]{64}")


def say(line):
    print(f"sparkform-scrub: {line}", flush=True)


class Pace:
    """Holds reading to `rate` bytes a second, counted from its start: after each read it sleeps
    until the bytes so far are due."""

    def __init__(self, rate, clock=time.monotonic, sleep=time.sleep):
        self.rate, self.clock, self.sleep = rate, clock, sleep
        self.started, self.done = clock(), 0

    def took(self, count):
        self.done += count
        ahead = self.done / self.rate - (self.clock() - self.started)
        if ahead > 0:
            self.sleep(ahead)


def hashed(path, pace):
    """(sha256, size) of the file at `path`, read at `pace`; a link is not followed. Each chunk
    leaves the page cache once read: the scrub must not push the engines' pages out."""
    handle = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.posix_fadvise(handle, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        digest, offset = hashlib.sha256(), 0
        while chunk := os.read(handle, CHUNK):
            digest.update(chunk)
            os.posix_fadvise(handle, offset, len(chunk), os.POSIX_FADV_DONTNEED)
            offset += len(chunk)
            pace.took(len(chunk))
        return digest.hexdigest(), offset
    finally:
        os.close(handle)


def manifest_files(folder, checkpoint: ServedCheckpoint):
    """The manifest's files ({path, size, sha256}), or a line saying why it is not one written
    for this checkpoint."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        return f"{MANIFEST} does not read ({type(err).__name__})"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list):
        return f"{MANIFEST} is not a manifest"
    if (manifest.get("repo"), manifest.get("commit")) != (checkpoint["repo"], checkpoint["commit"]):
        return f"{MANIFEST} names another checkpoint"
    for entry in manifest["files"]:
        if not (
            isinstance(entry, dict)
            and relative_file(entry.get("path"))
            and isinstance(entry.get("size"), int)
            and SHA256.fullmatch(str(entry.get("sha256")))
        ):
            return f"{MANIFEST} holds an entry of another shape"
    return manifest["files"]


def mismatches(folder, files, pace):
    """One line per file of the manifest that is not as it recorded, and the bytes read."""
    found, read = [], 0
    for entry in files:
        try:
            digest, size = hashed(folder / entry["path"], pace)
        except FileNotFoundError:
            found.append(f"{entry['path']}: missing")
            continue
        except OSError as err:
            found.append(f"{entry['path']}: {err.strerror}")
            continue
        read += size
        if size != entry["size"]:
            found.append(f"{entry['path']}: size {size} instead of {entry['size']}")
        elif digest != entry["sha256"]:
            found.append(f"{entry['path']}: sha256 differs from its manifest's")
    return found, read


def alert(settings: ScrubSettings, event, engine, message):
    """Through sparkform-guard: the journal (its MESSAGE_ID; this unit's journal too), the webhook,
    the command, the metric. Should the guard fail, the message is still said here."""
    result = subprocess.run([*ROOT_PYTHON, settings["guard"], "alert", event, engine, message], check=False)
    if result.returncode != 0:
        say(f"{message} (the alert through {settings['guard']} failed: exit {result.returncode})")


def fetch_environment(settings: ScrubSettings):
    """The fetch's environment: the hub and the token (read from root's file, never in argv)."""
    env = {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HOME": "/tmp/sparkform-scrub-hf"}
    if endpoint := settings.get("hf_endpoint"):
        env["HF_ENDPOINT"] = endpoint
    if token_file := settings.get("hf_token_file"):
        env["HF_TOKEN"] = Path(token_file).read_text().strip()
    return env


def repair(settings: ScrubSettings, checkpoint: ServedCheckpoint, found=None):
    """Report what was found (none on a retry), then with the host lock held (no deploy or
    rollback beside it): unmark, fetch again, start its engines on it. True once fetched."""
    folder = Path(checkpoint["folder"])
    names = ", ".join(engine["name"] for engine in checkpoint["engines"])
    for engine in checkpoint["engines"] if found else []:
        alert(
            settings,
            "checkpoint-corrupt",
            engine["name"],
            f"{folder} (served by {names}): {'; '.join(found)}: fetching it again",
        )
    what = f"sparkform-scrub's repair of {folder}"
    with hostlock.held(
        settings["host_lock_wait_s"],
        settings["host_lock"],
        what,
        lambda line: say(f"{folder}: the repair waits for the run that holds the host: {line}"),
    ) as locked:
        if not locked:
            say(f"{folder}: another run held the host for the whole wait: not repaired")
            return retried(settings, checkpoint, "another run held the host")
        (folder / MARKER).unlink(missing_ok=True)
        fetched: int | str  # the exit code, or why the fetch did not run
        try:
            fetched = subprocess.run(checkpoint["fetch"], env=fetch_environment(settings), check=False).returncode
        except OSError as err:
            fetched = f"{type(err).__name__}: {err.strerror}"
        if fetched != 0:
            return retried(
                settings, checkpoint, f"fetching it again failed (exit {fetched}; journalctl -u sparkform-scrub)"
            )
        failures = repairs(settings).pop(checkpoint["folder"], {}).get("failures", 0)
        save_repairs(settings, checkpoint["folder"], None)
        for engine in checkpoint["engines"]:
            outcome = restarted(engine["unit"])
            tries = f" after {failures} failed tries" if failures else ""
            alert(
                settings,
                "checkpoint-repaired",
                engine["name"],
                f"{folder}: fetched again and verified{tries}; {engine['unit']} {outcome}",
            )
        return True


def restarted(unit):
    """The engine on the repaired checkpoint: restarted if it runs, started again if it failed
    (its starts were refused meanwhile: the checkpoint lacked its marker). How it went, in words."""
    if active_state(unit) == "failed":
        code, done = started_afresh(unit), "started again"
    else:
        code, done = systemctl("try-restart", unit).returncode, "restarted on it (if it ran)"
    return done if code == 0 else f"its restart failed (exit {code}; journalctl -u {unit})"


# The repairs that failed: their folder -> {"failures": N, "since": epoch s}, in root's record folder.
RETRY_UNIT = "sparkform-scrub-retry"


def repairs(settings: ScrubSettings):
    found = read_json(settings["repairs"], {})
    return {k: v for k, v in found.items() if isinstance(v, dict) and isinstance(v.get("failures"), int)}


def save_repairs(settings: ScrubSettings, folder, entry):
    """The folder's entry replaced (None: removed); the file replaced whole."""
    current = repairs(settings)
    if entry is None:
        current.pop(folder, None)
    else:
        current[folder] = entry
    write_json(settings["repairs"], current)


def retried(settings: ScrubSettings, checkpoint: ServedCheckpoint, why):
    """A repair that failed: counted, tried again after a pause that doubles each time (a transient
    timer runs `--retry`), and told once, at the first failure. Always False."""
    folder = checkpoint["folder"]
    entry = repairs(settings).get(folder, {"failures": 0, "since": round(time.time())})
    entry["failures"] += 1
    save_repairs(settings, folder, entry)
    delay = doubled_pause(settings["retry_s"], entry["failures"], settings["retry_max_s"])
    # One unit per try: the try that schedules the next one runs in the unit of its own.
    subprocess.run(["systemctl", "stop", f"{RETRY_UNIT}-*.timer"], capture_output=True, check=False)
    scheduled = run_later(
        f"{RETRY_UNIT}-{entry['failures']}",
        delay,
        "sparkform: a checkpoint repair tried again",
        [*ROOT_PYTHON, program_path(), "--retry"],
        collect=True,
    )
    then = f"try {entry['failures'] + 1} in {delay} s" if scheduled else "no retry (systemd-run failed)"
    message = (
        f"{folder}: {why}: {then}; until it verifies, the engines keep what they loaded and a start of "
        f"{', '.join(e['name'] for e in checkpoint['engines'])} is refused"
    )
    say(message)
    if entry["failures"] == 1:
        for engine in checkpoint["engines"]:
            alert(settings, "checkpoint-repair-failed", engine["name"], message)
    return False


def mib_per_s(text):
    """A rate of at least 1 MiB/s: 0 or less would mean no bound at all."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of MiB/s of 1 or more")
    return value


def retry(settings: ScrubSettings):
    """The repairs that failed, tried again (a folder a deploy fetched meanwhile, or one no
    engine serves any more, is dropped). Exit code as main's."""
    failed = False
    served = {checkpoint["folder"]: checkpoint for checkpoint in settings["checkpoints"]}
    for folder in repairs(settings):
        checkpoint = served.get(folder)
        try:
            complete = (Path(folder) / MARKER).read_text().strip()
        except OSError:
            complete = None
        if checkpoint is None or complete == checkpoint["commit"]:
            say(f"{folder}: {'no engine serves it' if checkpoint is None else 'complete again (a deploy)'}: no retry")
            save_repairs(settings, folder, None)
            continue
        failed |= not repair(settings, checkpoint)
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="sparkform-scrub")
    parser.add_argument("--check-only", action="store_true", help="report, change nothing")
    parser.add_argument("--retry", action="store_true", help="try the repairs that failed again, nothing else")
    parser.add_argument(
        "--rate-mib-s", type=mib_per_s, metavar="R", help="read at most R MiB/s (the config's unless told)"
    )
    args = parser.parse_args()
    try:
        settings: ScrubSettings = json.loads(Path(settings_path(program_path())).read_text())
    except (OSError, ValueError) as err:
        print(f"sparkform-scrub: cannot read its config: {err}", file=sys.stderr)
        return 2
    if args.retry:
        return retry(settings)
    pace = Pace((args.rate_mib_s or settings["rate_mib_s"]) * 1024 * 1024)
    failed = False
    pending = repairs(settings)
    for checkpoint in settings["checkpoints"]:
        folder = Path(checkpoint["folder"])
        try:
            complete = (folder / MARKER).read_text().strip()
        except OSError:
            complete = None
        if checkpoint["commit"] is None or complete != checkpoint["commit"]:
            if checkpoint["folder"] in pending and not args.check_only:
                failed |= not repair(settings, checkpoint)  # a repair that failed before: now, not at its timer
            else:
                say(f"{folder}: not complete at its commit; the next deploy fetches it")
            continue
        started = time.monotonic()
        files = manifest_files(folder, checkpoint)
        found, read = ([files], 0) if isinstance(files, str) else mismatches(folder, files, pace)
        took = time.monotonic() - started
        if not found:
            say(
                f"{folder}: {len(files)} files, {read / 2**20:,.0f} MiB as their manifest recorded "
                f"({took:.0f} s, {read / 2**20 / max(took, 0.001):,.0f} MiB/s)"
            )
        elif args.check_only:
            say(f"{folder}: {'; '.join(found)}")
            failed = True
        else:
            failed |= not repair(settings, checkpoint, found)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
