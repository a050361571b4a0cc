"""The guard's watchdog: one thread per engine with an API on this host, from the engine's exec
on. While it starts, its StartJudge (sparkform.host.starts); once systemd counts it started, its
probe (a one-token completion; an embedding or a rerank for a pooling engine) with a deadline
every interval, judged by a HangJudge. A failed start's or a hung engine's whole cgroup is killed
and systemd starts it again."""

import json
import os
import threading
import time

from sparkform.host import GuardEngine, GuardSettings, engine_api, outages, procs
from sparkform.host.alerts import alert, journal
from sparkform.host.ranks import waits_for_ranks
from sparkform.host.starts import PROGRESS_CPU_SHARE, STARVED_STALLS, STOPPED_S, StartJudge, launch_state
from sparkform.host.systemd import active_state, journal_cursor, systemctl, unit_state

# Counters that move whenever an engine works on a request (prefill or decode).
PROGRESS_COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
# A probe's answer is a token, a small vector or one document's score: far less than this.
PROBE_ANSWER_BYTES = 4 * 2**20
METRICS_BYTES = 8 * 2**20  # an engine's /metrics page: a few hundred lines


def probe(engine: GuardEngine, deadline_s):
    """Whether the engine's probe (sparkform.domain.engine.PROBES: a one-token completion, an embedding,
    a rerank of one document) came back within the deadline with its answer, a non-empty list."""
    spec = engine["probe"]
    got = engine_api.answer(engine["socket"], spec["route"], deadline_s, PROBE_ANSWER_BYTES, spec["body"])
    if got is None or got[0] != 200:
        return False
    return isinstance(answer := probe_answer(got[1], spec["answer"]), list) and bool(answer)


def probe_answer(body: bytes, field):
    """`field` of the JSON object `body` (None for anything else). The engine, the process that
    parses untrusted prompts, wrote it, and root reads it: bounded in size, its nesting bounded by
    the decoder (RecursionError), a value of another type is no answer."""
    if len(body) > PROBE_ANSWER_BYTES:
        return None
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return value.get(field) if isinstance(value, dict) else None


def progress(engine: GuardEngine, deadline_s):
    """The sum of the engine's token counters (None: /metrics did not answer). The text comes
    from the engine, the process that parses untrusted prompts: only numbers are taken from it."""
    got = engine_api.answer(engine["socket"], "/metrics", deadline_s, METRICS_BYTES)
    if got is None or got[0] != 200:
        return None
    text = got[1][:METRICS_BYTES].decode("utf-8", "replace")
    total = 0.0
    for line in text.splitlines():
        name, _, rest = line.partition("{") if "{" in line else line.partition(" ")
        if name.strip() in PROGRESS_COUNTERS:
            try:
                total += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return total


def starved(threshold):
    """Whether the machine is starved now: CPU, IO or memory pressure (PSI, some avg10) at
    `threshold` %."""
    for resource in ("cpu", "io", "memory"):
        try:
            with open(f"/proc/pressure/{resource}") as handle:
                words = handle.readline().split()
        except OSError:
            continue
        for word in words:
            key, _, value = word.partition("=")
            if key == "avg10" and value.replace(".", "", 1).isdigit() and float(value) >= threshold:
                return True
    return False


class HangJudge:
    """The watchdog's decision for one engine: hung = `limit` failed probes in a row and no
    progress in its token counters since the first of them (a long prefill is progress, a hang
    is not; counters that do not answer prove nothing either way). On a starved machine (PSI)
    slow probes are not evidence: the verdict waits up to STARVED_ROUNDS x `limit` failures,
    unless a process of the engine is stopped, which nothing but a SIGCONT ends."""

    STARVED_ROUNDS = 3

    def __init__(self, limit):
        self.limit = limit
        self.forget()

    def forget(self):
        """A fresh count: the engine answered, was killed, or is not the watchdog's (starting, stopped)."""
        self.failures, self.baseline = 0, None

    def judge(self, answered, counters, starved=lambda: False, stopped=lambda: False):
        """This round's verdict: "serves" (it answered), "waits" (a failure short of the limit),
        "busy" (the limit, but the counters moved), "starved" (the limit on a starved machine,
        nothing stopped: it waits on) or "hung". `counters()` reads the engine's token counters'
        sum (None: they did not answer): at the first failure (again before the limit while it gets
        None) and from the limit on."""
        if answered:
            self.forget()
            return "serves"
        self.failures += 1
        if self.failures == 1 or (self.baseline is None and self.failures < self.limit):
            # At the first failure, and again while /metrics does not answer (a loaded engine's
            # may miss one deadline): progress is counted from the first reading there is.
            self.baseline = counters()
        if self.failures < self.limit:
            return "waits"
        if stopped():
            self.forget()
            return "hung"
        now, baseline = counters(), self.baseline
        if now is not None and baseline is not None and now > baseline:
            self.forget()
            return "busy"
        if baseline is None:
            self.baseline = now  # a starved spell's later rounds compare with it
        if self.failures < self.limit * self.STARVED_ROUNDS and starved():
            return "starved"
        self.forget()
        return "hung"


class Watchdog(threading.Thread):
    """One engine, from its exec on: while it starts, its StartJudge; once systemd counts it
    started, its probes judged by a HangJudge. A failed start's or a hung engine's whole cgroup is
    killed and systemd starts it again. `serving` holds the engines that answered last round."""

    def __init__(self, config: GuardSettings, engine: GuardEngine, held, serving, beats):
        super().__init__(daemon=True, name=f"watchdog {engine['name']}")
        self.config, self.engine, self.held, self.serving, self.beats = config, engine, held, serving, beats
        self.python_gone = False

    def look_at_python(self):
        """An engine that runs while its venv's python is gone will not start again (the launch
        exits 10): a human is told once, and the journal says when it is back. Looked at every
        round the unit is active, answering or not (a loaded engine may miss its probes)."""
        gone = not os.path.exists(self.engine["python"])
        unit, python = self.engine["unit"], self.engine["python"]
        if gone and not self.python_gone:
            alert(
                self.config,
                "cannot-restart",
                self.engine["name"],
                f"{unit} runs, but its python {python} is gone: its next start will fail; "
                "the deploy installs its venv again: pyinfra INVENTORY deploy.py",
            )
        elif self.python_gone and not gone:
            journal(self.config, f"sparkform-guard: {unit}'s python {python} is there again", 5)
        self.python_gone = gone

    def kill(self, event, why):
        outages.guard_kills(self.config, self.engine["name"], why)
        systemctl("kill", "--signal=SIGKILL", self.engine["unit"])
        alert(self.config, event, self.engine["name"], f"{self.engine['unit']} {why}: killed, systemd starts it again")

    def stopped_processes(self):
        cgroup = procs.unit_cgroup(self.engine["unit"])
        return procs.stopped_pids(procs.cgroup_pids(cgroup)) if cgroup else []

    def has_a_stopped_process(self):
        return bool(self.stopped_processes())

    def watch_start(self, start):
        """One look at a start (the unit "activating" with its commands running)."""
        config, engine = self.config, self.engine
        cgroup = procs.unit_cgroup(engine["unit"])
        if (
            not cgroup
            or launch_state(config["lock_dir"], engine["name"]).startswith("waiting")
            or waits_for_ranks(engine)
        ):
            # Not running yet, waiting its turn behind a loading neighbour, or a head waiting for
            # its ranks on other hosts (a rebooting worker's guard watches the rank's own start).
            start.forget()
            return
        strangers = procs.strangers(engine["socket"], cgroup)
        if strangers:
            start.forget()
            self.kill("stalled", f"cannot serve: its socket {engine['socket']} is held by {'; '.join(strangers)}")
            return
        pids = procs.cgroup_pids(cgroup)
        stopped = procs.stopped_pids(pids)
        now = time.monotonic()
        verdict = start.judge(
            now,
            bool(stopped),
            journal_cursor(engine["unit"]),
            procs.cpu_seconds(cgroup),
            lambda: starved(config["pressure_starved_pct"]),
        )
        if verdict == "starved" and not start.told_starved:
            start.told_starved = True
            journal(
                config,
                f"sparkform-guard: {engine['unit']} made no progress during its start for "
                f"{start.quiet_s(now):.0f} s on a starved machine: waiting (up to {STARVED_STALLS} x start_stall_s)",
                5,
            )
        elif verdict == "stopped":
            start.forget()
            self.kill("stalled", f"stopped during its start: process {', '.join(procs.describe(p) for p in stopped)}")
        elif verdict == "stalled":
            quiet = start.quiet_s(now)
            start.forget()
            self.kill(
                "stalled",
                f"made no progress during its start for {quiet:.0f} s (no journal line, under "
                f"{100 * PROGRESS_CPU_SHARE:.0f} % of a CPU; start_stall_s {config['start_stall_s']})",
            )

    def run(self):
        config, engine = self.config, self.engine
        deadline_s, judge = config["watchdog_deadline_s"], HangJudge(config["watchdog_failures"])
        start = StartJudge(config["start_stall_s"])
        next_round, stopped_since = time.monotonic(), None
        while True:
            self.beats.beat(engine["name"], config["watchdog_interval_s"] + 4 * deadline_s + 60)
            state, sub = unit_state(engine["unit"])
            if engine["name"] not in self.held and state == "activating" and sub in ("start", "start-post"):
                judge.forget()
                self.serving.discard(engine["name"])
                self.watch_start(start)
                time.sleep(config["start_poll_s"])
                next_round = time.monotonic()
                continue
            start.forget()
            # Rounds start every interval, however long a probe took: a hang is called within
            # (K - 1) x interval + two deadlines of its first failed probe.
            next_round += config["watchdog_interval_s"]
            time.sleep(max(0.0, next_round - time.monotonic()))
            if engine["name"] in self.held or active_state(engine["unit"]) != "active":
                judge.forget()  # restarting or stopped: not the watchdog's
                self.serving.discard(engine["name"])
                stopped_since = None
                continue
            # A process of the engine stopped (SIGSTOP) serves nothing until someone sends SIGCONT:
            # no probe needed, looked at again in start_poll_s and killed once stopped STOPPED_S.
            stopped = self.stopped_processes()
            if stopped:
                stopped_since = stopped_since or time.monotonic()
                self.serving.discard(engine["name"])
                if time.monotonic() - stopped_since < STOPPED_S:
                    next_round = time.monotonic() + config["start_poll_s"] - config["watchdog_interval_s"]
                    continue
                judge.forget()
                stopped_since = None
                self.kill(
                    "hung", f"has had a stopped process for {STOPPED_S} s: {', '.join(map(procs.describe, stopped))}"
                )
                next_round = time.monotonic()
                continue
            stopped_since = None
            self.look_at_python()
            verdict = judge.judge(
                probe(engine, deadline_s),
                lambda: progress(engine, deadline_s),
                lambda: starved(config["pressure_starved_pct"]),
                self.has_a_stopped_process,
            )
            (self.serving.add if verdict == "serves" else self.serving.discard)(engine["name"])
            if verdict == "busy":
                journal(
                    config,
                    f"sparkform-guard: {engine['unit']} answered no probe for {judge.limit} rounds "
                    "but its token counters moved: busy, not hung",
                    5,
                )
            elif verdict == "starved":
                journal(config, f"sparkform-guard: {engine['unit']} answers no probe on a starved machine: waiting", 5)
            elif verdict == "hung":
                self.kill(
                    "hung",
                    f"answered none of {judge.limit} probes ({engine['probe']['route']}, {deadline_s} s each, "
                    f"every {config['watchdog_interval_s']} s) and made no progress",
                )
                next_round = time.monotonic()
