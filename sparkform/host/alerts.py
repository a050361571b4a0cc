"""How sparkform tells a human, on the host: a journal entry with the alerts' MESSAGE_ID, the
webhook, the alert command, and the count of each alert in node_exporter's textfile (used by
sparkform-guard, which every other program alerts through)."""

import fcntl
import json
import os
import re
import socket
import subprocess
import sys
import time

from sparkform.host import ALERT_MESSAGE_ID as MESSAGE_ID
from sparkform.host import ROOT_PYTHON, GuardSettings
from sparkform.host.textfile import metric_family, write_textfile
from sparkform.host.whole_files import replaced

JOURNAL_SOCKET = "/run/systemd/journal/socket"
SEVERITY = {
    "memory-low": 4,
    "recovered": 5,
    "memory-recovered": 5,
    "drift": 5,
    "checkpoint-repaired": 5,
    "rebooted": 5,
    "front-recovered": 5,
    "disk-recovered": 5,
}  # else 3
# The alerts each engine can get, and those of the host (engine "-"): counted from zero.
ENGINE_EVENTS = (
    "stopped",
    "stalled",
    "hung",
    "failed",
    "cannot-restart",
    "recovered",
    "memory-critical",
    "memory-recovered",
    "checkpoint-corrupt",
    "checkpoint-repair-failed",
    "checkpoint-repaired",
    "rolled-back",
)  # the last four from sparkform-scrub and sparkform-rollback
HOST_EVENTS = (
    "memory-low", "drift", "rebooted", "unclean-reboot", "guard-restarted", "front-down", "front-recovered",
    "disk-full", "disk-recovered",
)  # fmt: skip
# An alert the webhook did not take waits in the outbox (root's, on disk) and is sent again, the
# oldest first, after a pause that doubles from OUTBOX_FIRST_S to OUTBOX_MAX_S while it fails.
OUTBOX_FIRST_S, OUTBOX_MAX_S, OUTBOX_KEPT = 10, 600, 1000


# --- telling a human ---------------------------------------------------------------------------


def journal(config: GuardSettings, message, priority=6, **fields):
    """One structured journal entry (journald's native protocol), on stderr when there is none."""
    lines = [
        f"MESSAGE={message}",
        f"PRIORITY={priority}",
        "SYSLOG_IDENTIFIER=sparkform-guard",
        *(f"{key.upper()}={value}" for key, value in fields.items()),
    ]
    data = "\n".join(line.replace("\n", " ") for line in lines).encode() + b"\n"
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.sendto(data, config.get("journal_socket", JOURNAL_SOCKET))
    except OSError:
        print(message, file=sys.stderr, flush=True)


def alert(config: GuardSettings, event, engine, message):
    """Journal entry with the fixed MESSAGE_ID and its count, then the webhook and the command,
    unless a flood folds it (`flooded`). Failures of either are journaled, never raised: an alert
    must not take the guard down."""
    journal(
        config, message, SEVERITY.get(event, 3), message_id=MESSAGE_ID, sparkform_event=event, sparkform_engine=engine
    )
    counted(config, event, engine)
    nth = flooded(config, event, engine, time.time())
    if nth > FLOOD_AFTER:
        return
    if nth == FLOOD_AFTER:
        message += (
            f" ({FLOOD_AFTER} such alerts in {FLOOD_WINDOW_S // 60} min: the next are folded into one, "
            f"sent once {FLOOD_WINDOW_S // 60} min pass without one; the journal has each)"
        )
    tell(config, event, engine, message)


def tell(config: GuardSettings, event, engine, message):
    """The webhook (in order, behind the kept alerts) and the alert command."""
    payload = json.dumps(
        {
            "host": socket.gethostname(),
            "event": event,
            "engine": engine,
            "message": message,
            "time": round(time.time(), 3),
        }
    ).encode()
    if webhook_url(config):
        waiting = pending(config)  # those before it go first: the receiver gets them in order
        tried = not waiting
        if waiting or not posted(config, payload):
            kept_or_sent(config, payload, tried)
    command = config.get("alert_command")
    if command:
        try:
            subprocess.run([command], input=payload, timeout=30, check=True, capture_output=True)
        except (OSError, subprocess.SubprocessError) as err:
            journal(config, f"sparkform-guard: the alert command {command} failed: {type(err).__name__}", 4)


# --- floods: a repeating alert becomes one ----------------------------------------------------------

# The FLOOD_AFTER-th alert of one event and engine within FLOOD_WINDOW_S says that the next are
# folded; they are journaled and counted, and one alert with their number goes out once the window
# passes without one (a guard in a restart loop, an engine that crashes at every start).
FLOOD_AFTER, FLOOD_WINDOW_S = 5, 120


def floods_path(config: GuardSettings):
    return os.path.join(config["state_dir"], "alert-floods.json")


def flooded(config: GuardSettings, event, engine, now):
    """How many alerts of this event and engine the window holds with this one (1: not a flood).
    Where the state cannot be read or written (a full disk) every alert goes out."""
    try:
        with open(os.path.join(config["state_dir"], "alerts.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            floods = read_json(floods_path(config), {})
            entry = floods.get(f"{event} {engine}")
            entry = entry if isinstance(entry, dict) else {}
            times = [t for t in flood_times(entry) if now - t < FLOOD_WINDOW_S]
            nth = len(times) + 1
            folded = entry.get("folded", 0) if isinstance(entry.get("folded"), int) else 0
            since = entry.get("since") if isinstance(entry.get("since"), float) else now
            if nth > FLOOD_AFTER:
                folded += 1
                entry = {"times": [*times[-FLOOD_AFTER:], now], "folded": folded, "since": since}
            else:
                entry = {"times": [*times, now], "folded": folded, **({"since": since} if folded else {})}
            floods[f"{event} {engine}"] = entry
            write_json(floods_path(config), floods)
            return nth
    except OSError:
        return 1


def flood_times(entry):
    """The times a flood entry holds (root's file, but never trusted to be of its shape)."""
    times = entry.get("times")
    return [t for t in times if isinstance(t, float)] if isinstance(times, list) else []


def unfold(config: GuardSettings, now):
    """One alert for each flood whose window passed without a new one: how many were folded and
    since when (the daemon's outbox thread calls it)."""
    try:
        with open(os.path.join(config["state_dir"], "alerts.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            floods = read_json(floods_path(config), {})
            quiet = {
                key: entry
                for key, entry in floods.items()
                if isinstance(entry, dict) and all(now - t >= FLOOD_WINDOW_S for t in flood_times(entry))
            }
            if not quiet:
                return
            write_json(floods_path(config), {k: v for k, v in floods.items() if k not in quiet})
    except OSError:
        return
    for key, entry in quiet.items():
        folded, since = entry.get("folded"), entry.get("since")
        if isinstance(folded, int) and folded > 0 and isinstance(since, float):
            event, _, engine = key.partition(" ")
            message = (
                f"{folded} more {event} alerts of {engine} were folded since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}; none for {FLOOD_WINDOW_S // 60} min"
            )
            journal(config, f"sparkform-guard: {message}", 5)
            tell(config, event, engine, message)


def webhook_url(config: GuardSettings):
    webhook_file = config.get("webhook_file")
    if not webhook_file or not os.path.exists(webhook_file):
        return None
    with open(webhook_file) as handle:
        return handle.read().strip()  # root's file: the URL often carries a token


# The webhook's whole exchange, in a child python killed at WEBHOOK_DEADLINE_S: urllib's timeout
# bounds each read, so a receiver that drips its answer would hold the guard's thread for minutes,
# and an answer it cannot parse (BadStatusLine) would end it. The URL comes on stdin (it often
# holds a token).
POST_CODE = """import sys, urllib.request
url = sys.stdin.buffer.readline().decode().strip()
request = urllib.request.Request(url, data=sys.stdin.buffer.read(), headers={"Content-Type": "application/json"})
urllib.request.urlopen(request, timeout=10).close()
"""
WEBHOOK_DEADLINE_S = 20
ERROR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]{0,80}")


def posted(config: GuardSettings, payload):
    """Whether the webhook took the alert within WEBHOOK_DEADLINE_S. Any failure (no answer, a
    status other than 2xx, an answer that is no HTTP) is journaled by its kind, never its URL,
    and the caller keeps the alert to send again."""
    try:
        result = subprocess.run(
            [*ROOT_PYTHON, "-c", POST_CODE],
            input=webhook_url(config).encode() + b"\n" + payload,
            capture_output=True,
            timeout=WEBHOOK_DEADLINE_S,
        )
    except subprocess.TimeoutExpired:
        why = f"no answer within {WEBHOOK_DEADLINE_S} s"
    except OSError as err:
        why = type(err).__name__
    else:
        if result.returncode == 0:
            return True
        # The exception's name only (the last line of the traceback): its text may quote the URL.
        last = (result.stderr.decode("utf-8", "replace").strip().splitlines() or ["?"])[-1].split(":")[0]
        why = last if ERROR_NAME.fullmatch(last) else f"exit {result.returncode}"
    journal(config, f"sparkform-guard: the alert webhook failed: {why}; kept to send again", 4)
    return False


def outbox(config: GuardSettings):
    path = os.path.join(config["state_dir"], "outbox")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def pending(config: GuardSettings):
    """The kept alerts' files, the oldest first (names start with the nanosecond they were kept)."""
    folder = outbox(config)
    return sorted(os.path.join(folder, name) for name in os.listdir(folder) if name.endswith(".json"))


def keep(config: GuardSettings, payload):
    folder = outbox(config)
    replaced(os.path.join(folder, f"{time.time_ns():020d}-{os.getpid()}.json"), payload)
    for dropped in pending(config)[:-OUTBOX_KEPT]:
        os.unlink(dropped)
        journal(config, f"sparkform-guard: more than {OUTBOX_KEPT} alerts wait for the webhook: the oldest dropped", 3)


def kept_or_sent(config: GuardSettings, payload, tried):
    """Keep an alert the webhook has not taken; where it cannot be kept (a full or read-only state
    folder) it is sent now, out of order (unless that just failed), rather than lost to the webhook."""
    try:
        keep(config, payload)
    except OSError as err:
        journal(config, f"sparkform-guard: an alert could not be kept in {outbox(config)}: {err}", 3)
        if tried or not posted(config, payload):
            journal(config, "sparkform-guard: that alert reached the journal only, not the webhook", 3)


def send_pending(config: GuardSettings):
    """Send the kept alerts in order; True when none is left."""
    for path in pending(config):
        with open(path, "rb") as handle:
            payload = handle.read()
        if not posted(config, payload):
            return False
        os.unlink(path)
    return True


def outbox_watch(config: GuardSettings, beats):
    """The daemon's thread: the kept alerts sent again with a pause doubling while they fail."""
    first = config.get("outbox_first_s", OUTBOX_FIRST_S)
    pause = first
    while True:
        beats.beat("outbox", pause + 60)  # a send takes at most its 10 s per alert, in practice
        time.sleep(pause)
        unfold(config, time.time())
        if not webhook_url(config) or not pending(config):
            pause = first
        elif send_pending(config):
            journal(config, "sparkform-guard: the kept alerts reached the webhook", 5)
            pause = first
        else:
            pause = min(2 * pause, OUTBOX_MAX_S)


def read_json(path, default):
    try:
        with open(path) as handle:
            value = json.load(handle)
    except (OSError, ValueError):
        return default
    return value if isinstance(value, dict) else default


def write_json(path, value):
    """Root's file, replaced whole (whole_files.replaced: a failed write raises, leaving no temp file)."""
    replaced(path, json.dumps(value))


# --- the alerts as metrics (node_exporter's textfile collector) -----------------------------------


def alert_counts(config: GuardSettings):
    """(event, engine) -> {"count", "time"} from the guard's state, every known pair from zero;
    an entry of another shape counts as none."""
    counts = {(event, e["name"]): {"count": 0} for e in config["engines"] for event in ENGINE_EVENTS}
    counts |= {(event, "-"): {"count": 0} for event in HOST_EVENTS}
    for key, entry in read_json(os.path.join(config["state_dir"], "alerts.json"), {}).items():
        event, _, engine = key.partition(" ")
        if isinstance(entry, dict) and isinstance(entry.get("count"), int) and isinstance(entry.get("time"), float):
            counts[(event, engine)] = {"count": entry["count"], "time": entry["time"]}
    return counts


def alert_metrics(counts):
    pairs = sorted(counts.items())
    return "".join(
        [
            metric_family(
                "sparkform_guard_alerts_total",
                "counter",
                'Alerts the guard sent, by event and engine (engine "-": the host).',
                [({"event": event, "engine": engine}, entry["count"]) for (event, engine), entry in pairs],
            ),
            metric_family(
                "sparkform_guard_last_alert_timestamp_seconds",
                "gauge",
                "When the guard last sent that alert.",
                [
                    ({"event": event, "engine": engine}, entry["time"])
                    for (event, engine), entry in pairs
                    if "time" in entry
                ],
            ),
        ]
    )


def counted(config: GuardSettings, event=None, engine=None):
    """Count one alert (none: only write the textfile) and rewrite the textfile. Under a lock:
    the daemon's threads, the recovery units and the deploy alert at the same time. A failure is
    journaled, never raised: metrics must not take the guard down."""
    if not config.get("textfile"):
        return
    try:
        with open(os.path.join(config["state_dir"], "alerts.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            counts = alert_counts(config)
            if event is not None:
                before = counts.get((event, engine), {"count": 0})
                counts[(event, engine)] = {"count": before["count"] + 1, "time": round(time.time(), 3)}
                write_json(
                    os.path.join(config["state_dir"], "alerts.json"),
                    {f"{e} {n}": entry for (e, n), entry in counts.items() if "time" in entry},
                )
            write_textfile(config["textfile"], alert_metrics(counts))
    except OSError as err:
        journal(config, f"sparkform-guard: the alert metrics were not written: {err}", 4)
