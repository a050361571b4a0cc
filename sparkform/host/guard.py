"""sparkform-guard COMMAND (run as root by the system's python3): what keeps the engines serving
when nobody watches, and tells a human. Everything it knows about the host is in the settings
file beside it, sparkform-guard.json (rendered from the inventory).

  watch                  the daemon (sparkform-guard.service). The watchdog: every engine that
                         systemd counts as started gets a one-token completion with a deadline on
                         its internal port; after K failures in a row with no progress in the
                         engine's own /metrics (a long prefill is progress, a hang is not) the
                         unit's whole cgroup is killed and systemd starts it again. The memory
                         guard: below the warning floor of MemAvailable an alert, below the
                         critical floor the lowest-priority engine is stopped before the kernel's
                         OOM killer picks a victim (cgroups do not see CUDA allocations on GB10),
                         and started again once memory is back above the warning floor + margin +
                         what the engine needs (so its start does not stop it again).
  served ENGINE          after the engine's readiness helper (ExecStartPost=+): a start that
                         served resets the unit's start counter, so only starts that never served
                         count towards the crash-loop limit; an engine back from a failure says so.
                         It also appends the KV pool this start printed to the ledger (below).
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
and the daemon samples the GPU with nvidia-smi (temperature, SM clock, the clock-event reasons:
thermal and hardware slowdowns) into another ("gpu_textfile") every gpu_poll_s.

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
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

if __name__ == "__main__":  # run by path on the host: its shared modules beside it (sparkform.host)
    sys.dont_write_bytecode, sys.path[:0] = True, [os.path.join(os.path.dirname(os.path.abspath(__file__)), "python")]

from sparkform.host import RETRY_UNIT_PREFIX, ROOT_PYTHON, settings_path  # noqa: E402
from sparkform.host.alerts import alert, counted, journal, read_json, write_json  # noqa: E402
from sparkform.host.gpu_metrics import gpu_watch  # noqa: E402
from sparkform.host.kvlog import INVOCATION_ID, JOURNAL_BYTES, LINE_CHARS, printed_pool, started_settings  # noqa: E402
from sparkform.host.memory_guard import memory_guard  # noqa: E402
from sparkform.host.ranks import RankWatch  # noqa: E402
from sparkform.host.systemd import active_state, systemctl  # noqa: E402

# Counters that move whenever an engine works on a request (prefill or decode).
PROGRESS_COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")


def load_config(path):
    with open(path) as handle:
        return json.load(handle)


def engine_of(config, name):
    for engine in config["engines"]:
        if engine["name"] == name:
            return engine
    print(
        f"sparkform-guard: no engine {name!r}; engines: {', '.join(e['name'] for e in config['engines'])}",
        file=sys.stderr,
    )
    raise SystemExit(2)


# --- recovery after a spent start limit ------------------------------------------------------------


def recover_state_path(config, engine):
    return os.path.join(config["state_dir"], f"recover-{engine['name']}.json")


def retry_delay(config, failures):
    """The cool-down, doubled for every failure after the first, up to the maximum."""
    return min(config["recover_cooldown_s"] * 2 ** (failures - 1), config["recover_backoff_max_s"])


def cmd_failed(config, engine):
    path = recover_state_path(config, engine)
    state = read_json(path, {})
    failures = state.get("failures") if isinstance(state.get("failures"), int) else 0
    failures += 1
    delay = retry_delay(config, failures)
    write_json(path, {"failures": failures, "since": state.get("since", round(time.time()))})
    timer = f"{RETRY_UNIT_PREFIX}{engine['name']}"
    systemctl("stop", f"{timer}.timer")  # a retry still pending from before
    systemctl("reset-failed", f"{timer}.service")
    scheduled = (
        subprocess.run(
            [
                "systemd-run",
                f"--unit={timer}",
                f"--on-active={delay}s",
                "--timer-property=AccuracySec=1s",
                f"--description=sparkform: start {engine['unit']} again after its failure",
                *ROOT_PYTHON,
                os.path.abspath(__file__),
                "retry",
                engine["name"],
            ],
            capture_output=True,
            timeout=60,
        ).returncode
        == 0
    )
    message = f"{engine['unit']} failed: its starts never served and it stopped after its start limit; " + (
        f"retry {failures} in {delay} s" if scheduled else "its retry could not be scheduled (systemd-run)"
    )
    if failures == 1:
        alert(config, "failed", engine["name"], message)
    else:
        journal(config, message, 3, sparkform_event="retry-scheduled", sparkform_engine=engine["name"])


def cmd_retry(config, engine):
    state = read_json(recover_state_path(config, engine), {})
    journal(
        config,
        f"sparkform-guard: starting {engine['unit']} again (retry {state.get('failures', '?')})",
        5,
        sparkform_event="retry",
        sparkform_engine=engine["name"],
    )
    systemctl("reset-failed", engine["unit"])
    systemctl("start", "--no-block", engine["unit"])


# --- the KV pool ledger ----------------------------------------------------------------------------


def start_journal(engine, invocation):
    """This start's journal lines (the engine's own output among them), at most JOURNAL_BYTES."""
    with subprocess.Popen(
        [
            "journalctl",
            "--no-pager",
            "-o",
            "cat",
            f"_SYSTEMD_UNIT={engine['unit']}",
            f"_SYSTEMD_INVOCATION_ID={invocation}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    ) as reader:
        data = reader.stdout.read(JOURNAL_BYTES)
        reader.kill()
    return [line[:LINE_CHARS] for line in data.decode("utf-8", "replace").splitlines()]


def append_row(config, row):
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
        fd, temp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".kv-ledger-")
        with os.fdopen(fd, "w") as handle:
            handle.write("\n".join(rows) + "\n")
        os.chmod(temp, 0o644)
        os.replace(temp, path)


def record_pool(config, engine):
    """Append this start's KV pool to the ledger; a start whose journal names none is journaled."""
    ledger = engine.get("ledger")
    if not config.get("kv_ledger") or not ledger:
        return
    invocation = os.environ.get("INVOCATION_ID", "")
    if not INVOCATION_ID.fullmatch(invocation):
        raise ValueError("no INVOCATION_ID of this start (run it as the unit's ExecStartPost=)")
    version, pool = printed_pool(start_journal(engine, invocation))
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


def cmd_served(config, engine):
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
        # Run outside the engine's cgroup: its IPAddressDeny= would block the webhook from here.
        subprocess.run(
            [
                "systemd-run",
                "--quiet",
                "--collect",
                "--no-block",
                *ROOT_PYTHON,
                os.path.abspath(__file__),
                "alert",
                "recovered",
                engine["name"],
                f"{engine['unit']} serves again after {state.get('failures', '?')} failed start limit(s)",
            ],
            check=False,
        )


# --- the daemon: watchdog and memory guard -------------------------------------------------------------


def probe(engine, deadline_s):
    """Whether a one-token completion came back within the deadline."""
    body = json.dumps({"model": engine["names"][0], "prompt": "ping", "max_tokens": 1}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{engine['port']}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=deadline_s) as response:
            return response.status == 200 and bool(json.load(response).get("choices"))
    except (OSError, ValueError):
        return False


def progress(engine, deadline_s):
    """The sum of the engine's token counters (None: /metrics did not answer). The text comes
    from the engine, the process that parses untrusted prompts: only numbers are taken from it."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{engine['port']}/metrics", timeout=deadline_s) as response:
            text = response.read(8 * 2**20).decode("utf-8", "replace")
    except OSError:
        return None
    total = 0.0
    for line in text.splitlines():
        name, _, rest = line.partition("{") if "{" in line else line.partition(" ")
        if name.strip() in PROGRESS_COUNTERS:
            try:
                total += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return total


class HangJudge:
    """The watchdog's decision for one engine: hung = `limit` failed probes in a row and no
    progress in its token counters since the first of them (a long prefill is progress, a hang
    is not; counters that do not answer prove nothing either way)."""

    def __init__(self, limit):
        self.limit = limit
        self.forget()

    def forget(self):
        """A fresh count: the engine answered, was killed, or is not the watchdog's (starting, stopped)."""
        self.failures, self.baseline = 0, None

    def judge(self, answered, counters):
        """This round's verdict: "serves" (it answered), "waits" (a failure short of the limit),
        "busy" (the limit, but the counters moved) or "hung". `counters()` reads the engine's
        token counters' sum (None: they did not answer): at the first failure and at the limit."""
        if answered:
            self.forget()
            return "serves"
        self.failures += 1
        if self.failures == 1:
            self.baseline = counters()
        if self.failures < self.limit:
            return "waits"
        now, baseline = counters(), self.baseline
        self.forget()
        return "busy" if now is not None and baseline is not None and now > baseline else "hung"


class Watchdog(threading.Thread):
    """One engine's probes, judged by a HangJudge; a hung engine's whole cgroup is killed."""

    def __init__(self, config, engine, held):
        super().__init__(daemon=True)
        self.config, self.engine, self.held = config, engine, held

    def run(self):
        config, engine = self.config, self.engine
        deadline_s, judge = config["watchdog_deadline_s"], HangJudge(config["watchdog_failures"])
        next_round = time.monotonic()
        while True:
            # Rounds start every interval, however long a probe took: a hang is called within
            # (K - 1) x interval + two deadlines of its first failed probe.
            next_round += config["watchdog_interval_s"]
            time.sleep(max(0.0, next_round - time.monotonic()))
            if engine["name"] in self.held or active_state(engine["unit"]) != "active":
                judge.forget()  # starting, restarting or stopped: not the watchdog's
                continue
            verdict = judge.judge(probe(engine, deadline_s), lambda: progress(engine, deadline_s))
            if verdict == "busy":
                journal(
                    config,
                    f"sparkform-guard: {engine['unit']} answered no probe for {judge.limit} rounds "
                    "but its token counters moved: busy, not hung",
                    5,
                )
            elif verdict == "hung":
                systemctl("kill", "--signal=SIGKILL", engine["unit"])
                alert(
                    config,
                    "hung",
                    engine["name"],
                    f"{engine['unit']} answered none of {judge.limit} one-token probes ({deadline_s} s each, "
                    f"every {config['watchdog_interval_s']} s) and made no progress: killed, systemd starts it again",
                )
                next_round = time.monotonic()


def cmd_watch(config):
    counted(config)  # the textfile, with every count, before any alert
    held = set()
    for engine in config["engines"]:
        (RankWatch(config, engine) if engine.get("head") else Watchdog(config, engine, held)).start()
    if config.get("gpu_textfile"):
        threading.Thread(target=gpu_watch, args=(config,), daemon=True).start()
    journal(config, f"sparkform-guard: watching {', '.join(e['name'] for e in config['engines']) or 'no engine'}", 6)
    memory_guard(config, held)


def main(argv):
    commands = {"watch": 0, "served": 1, "failed": 1, "retry": 1, "alert": 3}
    if not argv or argv[0] not in commands or len(argv) - 1 != commands[argv[0]]:
        print(
            "usage: sparkform-guard watch | served ENGINE | failed ENGINE | retry ENGINE | alert EVENT ENGINE MESSAGE",
            file=sys.stderr,
        )
        return 2
    try:
        config = load_config(settings_path(__file__))
    except (OSError, ValueError) as err:
        print(f"sparkform-guard: cannot read its config: {err}", file=sys.stderr)
        return 2
    command, args = argv[0], argv[1:]
    if command == "watch":
        cmd_watch(config)
    elif command == "alert":
        alert(config, *args)
    else:
        {"served": cmd_served, "failed": cmd_failed, "retry": cmd_retry}[command](config, engine_of(config, args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
