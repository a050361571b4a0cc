"""sparkform-guard COMMAND (run as root by the system's python3): what keeps the engines serving
when nobody watches, and tells a human. Everything it knows about the host is in the settings
file beside it, sparkform-guard.json (rendered from the inventory).

  watch                  the daemon (sparkform-guard.service, Type=notify: systemd restarts a guard
                         whose keep-alives stop, sparkform.host.keepalive). The watchdog
                         (sparkform.host.watchdog): a start is watched for progress from the
                         engine's exec on (a stopped process or no progress for start_stall_s
                         fails it); an engine that systemd counts as started gets a one-token
                         completion with a deadline on its socket; after K failures in a
                         row with no progress in the engine's own /metrics (a long prefill is
                         progress, a hang is not; slow probes on a starved machine are not
                         evidence) the unit's whole cgroup is killed and systemd starts it again.
                         The front's watch: a keyed request through nginx to each serving engine.
                         The memory guard: below the warning floor of MemAvailable an alert,
                         below the critical floor the lowest-priority engine is stopped before
                         the kernel's OOM killer picks a victim (cgroups do not see CUDA
                         allocations on GB10), and started again once memory is back above the
                         warning floor + margin + what the engine needs. The outbox: alerts the
                         webhook did not take, sent again with a growing pause. At its start, a
                         reboot or a guard that died is alerted (sparkform.host.outages).
  served ENGINE          after the engine's readiness helper (ExecStartPost=+): a start that
                         served resets the unit's start counter, so only starts that never served
                         count towards the crash-loop limit; an engine back from a failure says so.
                         It also appends the KV pool this start printed to the ledger (below),
                         and starts the engines target when every other engine is up or starting.
  stopped ENGINE         ExecStopPost=+ of the engine: a stop nobody asked for (no stop or restart
                         job) opens an outage with one alert (why: exit code, signal, OOM, the
                         last error line), closed by `served` with "serves again after N s".
  failed ENGINE          OnFailure= of the engine (sparkform-recover@ENGINE.service): the unit
                         spent its start limit. Alert once, then reset and start it again after
                         the cool-down, doubling it each time it fails again (up to the maximum).
  retry ENGINE           that delayed start (a transient timer, `systemctl list-timers`).
  alert EVENT ENGINE MESSAGE
                         tell a human: a journal entry with the alerts' MESSAGE_ID
                         (sparkform.host.alerts; `journalctl MESSAGE_ID=...`), a JSON POST to the webhook and
                         the alert command, each if configured. Alerts hold no secret. The
                         deploy (drift), sparkform-scrub (checkpoint-corrupt, -repaired) and
                         sparkform-rollback (rolled-back) send theirs this way.

With monitoring on (the config's "textfile"), every alert is also counted, per event and engine,
in sparkform_guard_alerts_total of a textfile for node_exporter, rewritten whole at each alert;
and the daemon samples the GPU with NVML (temperature, SM clock, the clock-event reasons: thermal
and hardware slowdowns) into another ("gpu_textfile") every gpu_poll_s, and counts the
front's requests per client from its access log into a third ("front_textfile").

The KV pool ledger (the config's "kv_ledger", root's): after each start that served, one JSON
line with the pool vLLM printed in this start's journal (KV GiB, tokens, concurrency at the
window, the version), the settings the engine started with (its args file, root's) and the
planner's prediction the deploy rendered for those settings (none when they differ: a rollback's
kept settings). The journal lines are the engine's own writing: only what the patterns take is
read, from at most JOURNAL_BYTES, and every number is bounded. The last kv_ledger_rows are kept.

Exit codes: 0 done; 2 usage, an unknown engine, or an unreadable config.
"""

import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from sparkform.host import (
    RETRY_UNIT_PREFIX,
    ROOT_PYTHON,
    GuardEngine,
    GuardSettings,
    outages,
    program_path,
    settings_path,
)
from sparkform.host.alerts import alert, counted, journal, outbox_watch, read_json
from sparkform.host.front import front_watch
from sparkform.host.front_clients import clients_watch
from sparkform.host.gpu_metrics import gpu_watch
from sparkform.host.keepalive import Beats, notify
from sparkform.host.kvlog import INVOCATION_ID, JOURNAL_BYTES, LINE_CHARS, printed_pool, started_settings
from sparkform.host.memory_guard import memory_guard
from sparkform.host.ranks import RankWatch
from sparkform.host.systemd import doubled_pause, invocation_journal, run_later, started_afresh, systemctl
from sparkform.host.target import reach_target_after, target_watch
from sparkform.host.watchdog import Watchdog
from sparkform.host.whole_files import replaced

KEEPALIVE_S = 5  # a keep-alive to systemd's watchdog (WatchdogSec= is several of these)
ALIVE_EVERY_S = 30  # the heartbeat on disk that tells a reboot (or a dead guard) at the next start


def load_config(path) -> GuardSettings:
    with open(path) as handle:
        return json.load(handle)


def engine_of(config: GuardSettings, name) -> GuardEngine:
    for engine in config["engines"]:
        if engine["name"] == name:
            return engine
    print(
        f"sparkform-guard: no engine {name!r}; engines: {', '.join(e['name'] for e in config['engines'])}",
        file=sys.stderr,
    )
    raise SystemExit(2)


# --- recovery after a spent start limit ------------------------------------------------------------


def recover_state_path(config: GuardSettings, engine: GuardEngine):
    return os.path.join(config["state_dir"], f"recover-{engine['name']}.json")


def cmd_failed(config: GuardSettings, engine: GuardEngine):
    path = recover_state_path(config, engine)
    state = read_json(path, {})
    failures = state.get("failures") if isinstance(state.get("failures"), int) else 0
    failures += 1
    delay = doubled_pause(config["recover_cooldown_s"], failures, config["recover_backoff_max_s"])
    # Unrecorded, the next retry's pause starts from the first again; the retry itself is still set.
    outages.recorded(
        config,
        path,
        {"failures": failures, "since": state.get("since", round(time.time()))},
        f"{engine['unit']}'s back-off",
    )
    timer = f"{RETRY_UNIT_PREFIX}{engine['name']}"
    systemctl("stop", f"{timer}.timer")  # a retry still pending from before
    systemctl("reset-failed", f"{timer}.service")
    scheduled = run_later(
        timer,
        delay,
        f"sparkform: start {engine['unit']} again after its failure",
        [*ROOT_PYTHON, program_path(), "retry", engine["name"]],
    )
    message = (
        f"{engine['unit']} failed: its starts never served and it stopped after its start limit; "
        f"{last_start_said(engine)}"
        + (f"retry {failures} in {delay} s" if scheduled else "its retry could not be scheduled (systemd-run)")
    )
    if failures == 1:
        alert(config, "failed", engine["name"], message)
    else:
        journal(config, message, 3, sparkform_event="retry-scheduled", sparkform_engine=engine["name"])


# systemd's ExecMainCode (the kernel's CLD_* codes) for a main process a signal ended.
KILLED_CODES = {"2": "", "3": " (core dumped)"}


def last_start_said(engine: GuardEngine):
    """How the unit's last start ended, for its alert: "its last start exited N: LINE; " (or "was
    killed by SIGNAME"), LINE the last line of that start's journal that names an error (a refusal
    of the launch script, vLLM's exception), or "" when systemd knows no status."""
    shown = systemctl("show", "-p", "ExecMainCode", "-p", "ExecMainStatus", "-p", "InvocationID", engine["unit"])
    values = dict(line.partition("=")[::2] for line in shown.stdout.splitlines())
    code, status, invocation = (values.get(key, "") for key in ("ExecMainCode", "ExecMainStatus", "InvocationID"))
    if not status.isdigit() or not INVOCATION_ID.fullmatch(invocation):
        return ""
    ended = f"exited {status}"
    if code in KILLED_CODES:
        try:
            ended = f"was killed by {signal.Signals(int(status)).name}{KILLED_CODES[code]}"
        except ValueError:
            ended = f"was killed by signal {status}{KILLED_CODES[code]}"
    words = outages.last_error_line(invocation_journal(engine["unit"], invocation, JOURNAL_BYTES, LINE_CHARS))
    return f"its last start {ended}" + (f": {words}" if words else "") + "; "


def cmd_retry(config: GuardSettings, engine: GuardEngine):
    state = read_json(recover_state_path(config, engine), {})
    journal(
        config,
        f"sparkform-guard: starting {engine['unit']} again (retry {state.get('failures', '?')})",
        5,
        sparkform_event="retry",
        sparkform_engine=engine["name"],
    )
    started_afresh(engine["unit"])


# --- the KV pool ledger ----------------------------------------------------------------------------


def append_row(config: GuardSettings, row):
    """The ledger with `row` appended and only its last kv_ledger_rows kept (replaced whole, under a
    lock: two engines may serve at once)."""
    path = config["kv_ledger"]
    with open(os.path.join(config["state_dir"], "kv-ledger.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with open(path) as handle:
                rows = handle.read(config["kv_ledger_rows"] * LINE_CHARS).splitlines()
        except FileNotFoundError:
            rows = []
        rows = [*rows[-(config["kv_ledger_rows"] - 1) :], json.dumps(row, separators=(",", ":"))]
        replaced(path, "\n".join(rows) + "\n", 0o644)


def record_pool(config: GuardSettings, engine: GuardEngine):
    """Append this start's KV pool to the ledger; a start whose journal names none is journaled."""
    ledger = engine.get("ledger")
    if not config.get("kv_ledger") or not ledger:
        return
    invocation = os.environ.get("INVOCATION_ID", "")
    if not INVOCATION_ID.fullmatch(invocation):
        raise ValueError("no INVOCATION_ID of this start (run it as the unit's ExecStartPost=)")
    version, pool = printed_pool(invocation_journal(engine["unit"], invocation, JOURNAL_BYTES, LINE_CHARS))
    if pool is None:
        journal(config, f"sparkform-guard: {engine['unit']} printed no KV cache size this start: no ledger row", 4)
        return
    settings = started_settings(ledger["args"])
    append_row(
        config,
        {
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "engine": engine["name"],
            "vllm": version,
            **settings,
            "measured": pool,
            "predicted": ledger["predicted"] if settings == ledger["settings"] else None,
        },
    )


def cmd_served(config: GuardSettings, engine: GuardEngine):
    # The start limit is for crash loops: a start that served must not count towards it.
    systemctl("reset-failed", engine["unit"])
    try:
        record_pool(config, engine)
    except (OSError, ValueError, subprocess.SubprocessError) as err:  # bookkeeping never fails a start
        journal(config, f"sparkform-guard: no KV ledger row for {engine['unit']}: {err}", 4)
    path = recover_state_path(config, engine)
    state = read_json(path, None)
    if state is not None:
        os.unlink(path)
        systemctl("stop", f"{RETRY_UNIT_PREFIX}{engine['name']}.timer")
    message = outages.served_again(config, engine, state.get("failures", "?") if state is not None else 0)
    if message:
        alert_outside(engine, "recovered", message)
    reach_target_after(config, engine)


def cmd_stopped(config: GuardSettings, engine: GuardEngine):
    outages.cmd_stopped(config, engine, lambda event, message: alert_outside(engine, event, message))


def alert_outside(engine: GuardEngine, event, message):
    """An alert from a command the engine's unit runs, sent from a unit of its own: the engine's
    IPAddressDeny= would block the webhook from its cgroup."""
    subprocess.run(
        ["systemd-run", "--quiet", "--collect", "--no-block", *ROOT_PYTHON, program_path(), "alert", event]
        + [engine["name"], message],
        check=False,
    )


# --- the daemon: watchdog and memory guard -------------------------------------------------------------


def cmd_watch(config: GuardSettings):
    counted(config)  # the textfile, with every count, before any alert
    outages.after_start(config)
    failing = outages.heartbeat(config, failing=False)

    def stop_cleanly(signum, frame):
        outages.heartbeat(config, failing, clean=True)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop_cleanly)
    held: set[str] = set()  # the engines the memory guard stopped
    serving: set[str] = set()  # the engines that answered the watchdog's last round
    beats = Beats()
    threads: list[threading.Thread] = [
        RankWatch(config, engine) if engine.get("head") else Watchdog(config, engine, held, serving, beats)
        for engine in config["engines"]
    ]
    named: dict[str, tuple[Callable[..., object], tuple]] = {
        "memory guard": (memory_guard, (config, held, beats)),
        "outbox": (outbox_watch, (config, beats)),
        "target": (target_watch, (config, beats)),
    }
    if config["fronts"]:
        named["front"] = (front_watch, (config, beats, serving))
    if config.get("gpu_textfile"):
        named["gpu"] = (gpu_watch, (config,))
    if config.get("front_textfile"):
        named["clients"] = (clients_watch, (config,))
    threads += [threading.Thread(target=run, args=args, name=name, daemon=True) for name, (run, args) in named.items()]
    died: dict[str, str] = {}

    def record_death(hook):  # threading.excepthook: runs in the dying thread, before it counts as dead
        died.setdefault(hook.thread.name if hook.thread else "?", f"{hook.exc_type.__name__}: {hook.exc_value}")

    threading.excepthook = record_death
    for thread in threads:
        thread.start()
    journal(config, f"sparkform-guard: watching {', '.join(e['name'] for e in config['engines']) or 'no engine'}", 6)
    notify("READY=1")
    dead = keep_alive(config, threads, beats, failing)
    # A thread that died would leave its work undone behind an active unit: the whole guard goes,
    # saying which and why, and systemd starts it again (the next guard's alert quotes this).
    why = "; ".join(f"its {name} thread died ({died.get(name, 'it returned')})" for name in dead)
    journal(config, f"sparkform-guard: {why}: it exits, and systemd starts it again", 2)
    outages.heartbeat(config, failing, why=why)
    raise SystemExit(1)


def keep_alive(config: GuardSettings, threads, beats, failing):
    """Tell systemd's watchdog the guard is alive while every thread keeps its promise, and keep
    the heartbeat on disk; return the names of the threads that died, once one did."""
    last_alive = time.monotonic()
    while True:
        dead = [thread.name for thread in threads if not thread.is_alive()]
        if dead:
            return dead
        if not beats.late():
            notify("WATCHDOG=1")
        if time.monotonic() - last_alive >= ALIVE_EVERY_S:
            failing = outages.heartbeat(config, failing)
            last_alive = time.monotonic()
        time.sleep(KEEPALIVE_S)


def main(argv):
    commands = {"watch": 0, "served": 1, "stopped": 1, "failed": 1, "retry": 1, "alert": 3}
    if not argv or argv[0] not in commands or len(argv) - 1 != commands[argv[0]]:
        print(
            "usage: sparkform-guard watch | served ENGINE | stopped ENGINE | failed ENGINE | retry ENGINE"
            " | alert EVENT ENGINE MESSAGE",
            file=sys.stderr,
        )
        return 2
    try:
        config = load_config(settings_path(program_path()))
    except (OSError, ValueError) as err:
        print(f"sparkform-guard: cannot read its config: {err}", file=sys.stderr)
        return 2
    command, args = argv[0], argv[1:]
    if command == "watch":
        cmd_watch(config)
    elif command == "alert":
        alert(config, *args)
    else:
        commands = {"served": cmd_served, "stopped": cmd_stopped, "failed": cmd_failed, "retry": cmd_retry}
        commands[command](config, engine_of(config, args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
