"""sparkform-guard, rendered and run for real as a process: alerts to a real journal socket, HTTP
webhook and command; recovery after a spent start limit; the watchdog against stub engines that
serve, hang or work slowly, each on its unix socket as an engine serves; the memory guard against a
meminfo it is handed. systemctl and systemd-run are stand-ins on PATH that record their calls (the
sandbox runs the real ones: tests/integration/test_watchful.py)."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from script_box import Journal, cpu_host_under, put
from standins import HANG, NOT_FOUND, PROBE_ANSWERS, Reply, Request, StubEngine, json_reply, recording_command
from unix_engines import raw_answer_once

from sparkform.host import alerts, engine_api, outages, starts, watchdog
from sparkform.host import guard as guard_program
from sparkform.host.front import KnownKey
from sparkform.host.front_keys import clients_snippet
from sparkform.rules.inventory import load_host
from sparkform.sandbox.alerts import make_server, read_alerts
from sparkform.writers.render import render_host

WEBHOOK_SECRET = "sf-webhook-token-0123456789"
# The two engines (name, priority) and their public ports (the front's: nothing here binds them).
ENGINES = (("hands", 1), ("eyes", 0))
PUBLIC_PORTS = (18001, 18002)


def engine_socket(socket_dir: Path, name: str) -> str:
    """Where an engine serves its own API: a folder of its own in the host's socket_dir."""
    return f"{socket_dir}/{name}/api.sock"


class GuardedAnswers:
    """Its kind's probe route answers at once ("ok"), never ("hung") or never while /metrics keeps
    counting tokens ("busy"); `serves` lists the routes it has (others: 404, as vLLM's pooling
    engine answers /v1/completions). The test may change `mode` as it runs."""

    mode: str
    tokens: int
    serves: tuple[str, ...]
    paths: Callable[..., list[str]]

    @property
    def probes(self) -> list[str]:
        """The probe routes asked for, in order."""
        return self.paths("POST")

    def _answer(self, request: Request) -> Reply:
        if request["method"] == "POST":
            if self.mode != "ok":
                return HANG
            return json_reply(PROBE_ANSWERS[request["path"]]) if request["path"] in self.serves else NOT_FOUND
        if self.mode == "busy":
            self.tokens += 100
        if self.mode == "hung":
            return HANG
        metrics = (
            f'# HELP x\nvllm:generation_tokens_total{{model_name="m"}} {self.tokens}.0\n'
            'vllm:prompt_tokens_total{model_name="m"} 7.0\n'
        )
        return Reply(body=metrics.encode(), content_type="text/plain")


class GuardedEngine(GuardedAnswers, StubEngine):
    """An engine, on its unix socket `path`."""

    def __init__(self, path: str, mode: str = "ok", serves: tuple[str, ...] = tuple(PROBE_ANSWERS)):
        self.mode, self.tokens, self.serves = mode, 0, serves
        StubEngine.__init__(self, self._answer, path=path)


class GuardedFront(GuardedAnswers, StubEngine):
    """The front (nginx) on a TCP port of 127.0.0.1: it answers /v1/models as the engine behind it
    answers /metrics (at once, or never while "hung")."""

    def __init__(self, mode: str = "ok"):
        self.mode, self.tokens, self.serves = mode, 0, tuple(PROBE_ANSWERS)
        StubEngine.__init__(self, self._answer)


# systemctl answers from files under {states}: a unit's "ActiveState SubState" (else active),
# its .enabled (else enabled), .pid and .cgroup.
SYSTEMCTL_ANSWER = """if [ "$1" = is-enabled ]; then
  for unit; do :; done
  [ "$(cat "{states}/$unit.enabled" 2>/dev/null || echo enabled)" = enabled ]; exit
fi
if [ "$1" = show ]; then
  for unit; do :; done
  if [ "$3" = MainPID ]; then cat "{states}/$unit.pid" 2>/dev/null || echo 0; exit 0; fi
  state=$(cat "{states}/$unit" 2>/dev/null || echo active)
  case "$3" in
    ActiveState,SubState) echo "ActiveState=${{state% *}}"; echo "SubState=${{state#* }}" ;;
    ControlGroup) cat "{states}/$unit.cgroup" 2>/dev/null || true ;;
    *) echo "${{state% *}}" ;;
  esac
fi"""
# An alert sent from a transient unit (outside the engine's cgroup) runs now; a timer does not.
SYSTEMD_RUN_ANSWER = """while [ "${1#--}" != "$1" ]; do shift; done
case " $* " in *" alert "*) exec "$@" ;; esac"""
ALERT_COMMAND = """#!/bin/sh
cat >> "{out}"
echo >> "{out}"
"""


def replace_text(path: Path, text: str) -> None:
    """Write a file the guard polls meanwhile as a new file renamed over the old one: it never
    reads one half-written (as /proc/meminfo and systemctl's answers never are)."""
    staged = path.with_name(f".{path.name}.new")
    staged.write_text(text)
    staged.replace(path)


class Guard:
    """The rendered guard with its config, stand-ins and receivers, all under `root`."""

    def __init__(
        self,
        root: Path,
        socket_dir: Path,
        engines: list[GuardedEngine],
        fronts=(),
        outbox_first_s=10,
        kinds=("generate",) * 2,
        **settings,
    ):
        self.root = root
        self.journal = Journal(root / "journal.sock")
        self.calls = root / "calls"
        self.states = root / "states"
        self.states.mkdir()
        self.meminfo = root / "meminfo"
        self.set_available_gib(50)
        self.command_out = root / "command.out"
        bin_dir = root / "bin"
        recording_command(bin_dir, "systemctl", self.calls, SYSTEMCTL_ANSWER.format(states=self.states))
        recording_command(bin_dir, "systemd-run", self.calls, SYSTEMD_RUN_ANSWER)
        command = root / "alert-command"
        command.write_text(ALERT_COMMAND.format(out=self.command_out))
        command.chmod(0o755)
        self.webhook = make_server("127.0.0.1", 0, root / "webhook.jsonl")
        threading.Thread(target=self.webhook.serve_forever, daemon=True).start()
        webhook_file = root / "webhook"
        webhook_file.write_text(f"http://127.0.0.1:{self.webhook.server_address[1]}/hook?token={WEBHOOK_SECRET}\n")
        webhook_file.chmod(0o600)
        config = load_host(
            "guard-test",
            {
                **cpu_host_under(root),
                "socket_dir": str(socket_dir),
                "alert_webhook_file": str(webhook_file),
                "alert_command": str(command),
                "engines": [
                    {
                        "name": name,
                        "port": port,
                        "kv_cache_memory_bytes": 2**28,
                        "priority": priority,
                        "kind": kind,
                        "checkpoint": {"repo": f"o/{name}", "revision": "main"},
                    }
                    for (name, priority), port, kind in zip(ENGINES, PUBLIC_PORTS, kinds, strict=True)
                ],
                **settings,
            },
        ).config
        rendered = render_host(config)
        put(rendered, root)
        self.script = Path(config.paths.guard)
        self.config_path = Path(config.paths.guard_config)
        guard_config = json.loads(self.config_path.read_text())
        # The guard reaches each engine where its stand-in serves, and by nothing else (no TCP port).
        assert [(e["name"], e["socket"]) for e in guard_config["engines"]] == [
            (name, str(stub.socket)) for (name, _), stub in zip(ENGINES, engines, strict=True)
        ]
        assert not [e for e in guard_config["engines"] if "port" in e]
        for engine in guard_config["engines"]:  # the venv's python each engine's launch execs: here
            engine["python"] = str(root / engine["python"].lstrip("/"))
            Path(engine["python"]).parent.mkdir(parents=True, exist_ok=True)
            Path(engine["python"]).touch()
        guard_config.update(
            journal_socket=str(self.journal.path),
            outage_spare_dir=str(root / "run" / "sparkform-outages"),
            meminfo=str(self.meminfo),
            webhook_file=str(config.paths.alert_webhook),
            memory_poll_s=0.2,
            memory_settle_s=0.5,
            start_poll_s=0.2,
            fronts=list(fronts),
            outbox_first_s=outbox_first_s,
            # Past any PSI reading: the verdicts wait on the engines' stand-ins, never on this
            # machine's load (the starved spell is HangJudge's and StartJudge's own tests').
            pressure_starved_pct=101,
        )
        Path(config.paths.alert_webhook).parent.mkdir(parents=True)
        Path(config.paths.alert_webhook).write_text(webhook_file.read_text())
        Path(guard_config["state_dir"]).mkdir(parents=True)
        self.state_dir = Path(guard_config["state_dir"])
        self.config_path.write_text(json.dumps(guard_config))
        self.env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
        self.daemon: subprocess.Popen | None = None

    def set_available_gib(self, gib: float) -> None:
        replace_text(self.meminfo, f"MemTotal:       125000000 kB\nMemAvailable:   {int(gib * 2**20)} kB\n")

    def set_state(self, unit: str, state: str) -> None:
        replace_text(self.states / unit, f"{state}\n")

    def run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(self.script), *args], env=self.env, capture_output=True, text=True, timeout=60
        )

    def watch(self) -> None:
        self.daemon = subprocess.Popen(
            [sys.executable, str(self.script), "watch"], env=self.env, stderr=subprocess.PIPE, text=True
        )

    def calls_made(self) -> list[str]:
        return self.calls.read_text().splitlines() if self.calls.exists() else []

    def changes_made(self) -> list[str]:
        """The calls that change something (not systemctl's questions)."""
        return [c for c in self.calls_made() if not c.startswith(("systemctl show ", "systemctl is-enabled "))]

    def webhook_alerts(self) -> list[dict]:
        return [entry["alert"] for entry in read_alerts(self.root / "webhook.jsonl")]

    def wait(self, predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            if self.daemon and self.daemon.poll() is not None:
                raise AssertionError(f"the guard exited {self.daemon.returncode}: {self.daemon.stderr.read()}")
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}; calls: {self.calls_made()}")

    def close(self) -> None:
        if self.daemon:
            self.daemon.kill()
            self.daemon.wait()
        self.webhook.shutdown()
        self.webhook.server_close()
        self.journal.sock.close()


@pytest.fixture
def guard(tmp_path, socket_dir):
    made: list[Guard] = []
    stubs: list[StubEngine] = []

    def _guard(modes=("ok", "ok"), front=None, serves=None, **settings) -> tuple[Guard, list[GuardedEngine]]:
        engines = [
            GuardedEngine(engine_socket(socket_dir, name), mode, *([serves[i]] if serves else []))
            for i, ((name, _), mode) in enumerate(zip(ENGINES, modes, strict=True))
        ]
        stubs.extend(engines)
        fronts = []
        if front is not None:  # a stub as the front of the second engine ("eyes")
            stubs.append(front)
            fronts = [{"engine": "eyes", "address": "127.0.0.1", "port": front.port}]
        made.append(Guard(tmp_path, socket_dir, engines, fronts=fronts, **settings))
        return made[-1], engines

    yield _guard
    for item in made:
        item.close()
    for stub in stubs:
        stub.close()


def test_an_alert_reaches_journal_webhook_and_command_with_no_secret(guard):
    box, _ = guard()
    result = box.run("alert", "drift", "-", "driver 580.95.05 -> 580.126.09")
    assert result.returncode == 0, result.stderr
    (entry,) = box.journal.alerts()
    assert entry["SPARKFORM_EVENT"] == "drift" and entry["MESSAGE"] == "driver 580.95.05 -> 580.126.09"
    (posted,) = box.webhook_alerts()
    assert posted["event"] == "drift" and posted["message"] == "driver 580.95.05 -> 580.126.09"
    assert posted["host"] == socket.gethostname()
    (commanded,) = [json.loads(line) for line in box.command_out.read_text().splitlines() if line]
    assert commanded == posted
    everything = json.dumps(box.journal.entries) + box.command_out.read_text() + json.dumps(posted)
    assert WEBHOOK_SECRET not in everything


def test_a_dead_webhook_is_journaled_and_the_alert_still_goes_out(guard):
    box, _ = guard()
    box.webhook.shutdown()
    box.webhook.server_close()
    result = box.run("alert", "hung", "hands", "x")
    assert result.returncode == 0, result.stderr
    assert [e["SPARKFORM_EVENT"] for e in box.journal.alerts()] == ["hung"]
    assert any("the alert webhook failed" in e["MESSAGE"] for e in box.journal.entries)
    assert box.command_out.read_text().strip()  # the command still got it


def hostile_webhook(answer: bytes, pause_s: float) -> tuple[str, threading.Event]:
    """A webhook on 127.0.0.1 that reads a request's head, then sends `answer` a byte at a time,
    `pause_s` apart, until set: its URL and the event that ends it."""
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve() -> None:
        # The guard's side hangs up once it gave up (at its deadline, or on an answer no HTTP).
        with listener, listener.accept()[0] as connection, contextlib.suppress(ConnectionError):
            while b"\r\n\r\n" not in connection.recv(65536):
                pass
            for byte in answer:
                if done.wait(pause_s):
                    return
                connection.sendall(bytes([byte]))
            done.wait()

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}/hook?token=secret", done


@pytest.mark.parametrize(
    ("answer", "pause_s", "why"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", 0.5, "no answer within 2 s"),  # drips
        (b"HTTP/1.1 banana\r\n\r\n", 0, "http.client.BadStatusLine"),
        (b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n", 0, "urllib.error.HTTPError"),
    ],
    ids=["drips", "no-http", "status-500"],
)
def test_a_webhook_that_drips_or_answers_no_http_fails_within_the_deadline(
    answer, pause_s, why, tmp_path, socket_dir, monkeypatch
):
    """The whole exchange is bounded (a webhook answering a byte every few seconds once held the
    guard's thread for minutes), and every failure is one: the caller keeps the alert. The journal
    names the failure's kind, never the URL (its token)."""
    monkeypatch.setattr(alerts, "WEBHOOK_DEADLINE_S", 2)
    url, done = hostile_webhook(answer, pause_s)
    (tmp_path / "webhook").write_text(url)
    journal = Journal(socket_dir / "journal")
    started = time.monotonic()
    try:
        took = alerts.posted({"webhook_file": str(tmp_path / "webhook"), "journal_socket": str(journal.path)}, b"{}")
    finally:
        done.set()
    assert took is False and time.monotonic() - started < 2 + 3
    (entry,) = journal.read()
    assert entry["MESSAGE"] == f"sparkform-guard: the alert webhook failed: {why}; kept to send again"


def test_a_spent_start_limit_alerts_once_and_retries_with_growing_back_off(guard):
    box, _ = guard(recover_cooldown_s=60, recover_backoff_max_s=200)
    for _ in range(4):
        assert box.run("failed", "eyes").returncode == 0
    assert [a["event"] for a in box.webhook_alerts()] == ["failed"]  # once, not at every retry
    runs = [call for call in box.calls_made() if call.startswith("systemd-run")]
    assert [call.split("--on-active=")[1].split()[0] for call in runs] == ["60s", "120s", "200s", "200s"]
    assert all("--unit=sparkform-retry-eyes" in call and call.endswith(f"{box.script} retry eyes") for call in runs)
    assert json.loads((box.state_dir / "recover-eyes.json").read_text())["failures"] == 4
    box.calls.unlink()
    assert box.run("retry", "eyes").returncode == 0
    assert box.calls_made() == [
        "systemctl reset-failed vllm-eyes.service",
        "systemctl start --no-block vllm-eyes.service",
    ]
    # It serves again: the back-off ends, and a human is told.
    assert box.run("served", "eyes").returncode == 0
    assert not (box.state_dir / "recover-eyes.json").exists()
    assert [a["event"] for a in box.webhook_alerts()] == ["failed", "recovered"]
    assert "after 4 failed start limit(s)" in box.webhook_alerts()[-1]["message"]
    assert box.changes_made()[-1].startswith("systemd-run --quiet --collect --no-block ")  # outside the engine's cgroup


INVOCATION = "0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize(
    ("shown", "lines", "said"),
    [
        # The launch's refusal, after its progress and before the reports of the end (wait-ready's,
        # and the guard's own of the stop, which quotes an earlier line).
        (
            f"ExecMainStatus=10\nInvocationID={INVOCATION}\n",
            [
                "sparkform-launch: eyes waits for engine hands, which is loading",
                "sparkform-launch: eyes's venv is gone or incomplete (no /v/bin/python); the deploy installs it again",
                "sparkform-wait-ready: engine main process 42 died after 1 s",
                "sparkform-guard: vllm-eyes.service stopped again: exit 10; its last error line: sparkform-launch: x",
            ],
            "its last start exited 10: sparkform-launch: eyes's venv is gone or incomplete (no /v/bin/python); the "
            "deploy installs it again; ",
        ),
        # vLLM's exception, with a control character the engine put in it.
        (
            f"ExecMainStatus=1\nInvocationID={INVOCATION}\n",
            ["sparkform-launch: starting eyes on /run/e/api.sock", "ValueError: no such\x1b[31m architecture"],
            "its last start exited 1: ValueError: no such [31m architecture; ",
        ),
        (f"ExecMainStatus=137\nInvocationID={INVOCATION}\n", ["INFO loading"], "its last start exited 137; "),
        # A start a signal ended: systemd's code says so, and the status is the signal's number.
        (
            f"ExecMainCode=2\nExecMainStatus=9\nInvocationID={INVOCATION}\n",
            ["INFO loading"],
            "its last start was killed by SIGKILL; ",
        ),
        (
            f"ExecMainCode=3\nExecMainStatus=11\nInvocationID={INVOCATION}\n",
            ["Fatal Python error: Segmentation fault"],
            "its last start was killed by SIGSEGV (core dumped): Fatal Python error: Segmentation fault; ",
        ),
        (
            f"ExecMainCode=2\nExecMainStatus=99\nInvocationID={INVOCATION}\n",
            [],
            "its last start was killed by signal 99; ",
        ),
        (f"ExecMainCode=1\nExecMainStatus=1\nInvocationID={INVOCATION}\n", [], "its last start exited 1; "),
        # Nothing systemd says is taken unchecked.
        ("ExecMainStatus=\nInvocationID=\n", [], ""),
        (f"ExecMainStatus=1\nInvocationID=../{INVOCATION}\n", ["Error: x"], ""),
    ],
)
def test_a_failed_alert_says_how_the_last_start_ended(monkeypatch, shown, lines, said):
    """The cause of a spent start limit, from the last start's own journal: what the launch
    refused or vLLM raised, never the lines that only report the end."""
    asked = []
    monkeypatch.setattr(
        guard_program, "systemctl", lambda *args: subprocess.CompletedProcess(args, 0, stdout=shown, stderr="")
    )
    monkeypatch.setattr(
        guard_program, "invocation_journal", lambda unit, invocation, *_: asked.append(invocation) or lines
    )
    engine = {"name": "eyes", "unit": "vllm-eyes.service"}
    assert guard_program.last_start_said(engine) == said
    assert asked in ([], [INVOCATION])


def test_a_start_that_served_resets_the_start_count_and_says_nothing_else(guard):
    box, _ = guard()
    assert box.run("served", "hands").returncode == 0
    assert box.changes_made() == ["systemctl reset-failed vllm-hands.service"]  # the target is up already
    assert box.webhook_alerts() == [] and box.journal.alerts() == []


def test_last_engine_to_serve_starts_engines_target_unless_one_is_stopped(guard):
    """The `served` hook: the target, down since a restart (it is Requisite= of the engines), is
    started at once by the engine whose start completes the set, not a watch interval later."""
    box, _ = guard()
    target = "sparkform-engines.target"
    start = f"systemctl start --no-block {target}"
    box.set_state(target, "inactive")
    box.set_state("vllm-eyes.service", "inactive")  # stopped by hand: the box is not whole
    assert box.run("served", "hands").returncode == 0
    assert start not in box.calls_made()
    box.set_state("vllm-eyes.service", "activating")  # starting too: the target's job waits for it
    assert box.run("served", "hands").returncode == 0
    assert box.changes_made() == ["systemctl reset-failed vllm-hands.service"] * 2 + [start]
    box.calls.unlink()
    box.set_state(f"{target}.enabled", "disabled")  # nobody asked for the target
    assert box.run("served", "hands").returncode == 0
    assert start not in box.calls_made()


@pytest.mark.parametrize("args", [[], ["served"], ["nosuch"], ["served", "ghost"]])
def test_usage_and_unknown_engines_exit_2(guard, args):
    box, _ = guard()
    result = box.run(*args)
    assert result.returncode == 2
    assert "usage" in result.stderr or "no engine 'ghost'; engines: hands, eyes" in result.stderr


FAST_WATCHDOG = {"watchdog_interval_s": 1, "watchdog_deadline_s": 1, "watchdog_failures": 2}


def test_the_watchdog_kills_a_hung_engine_and_leaves_the_others(guard):
    box, (hands, eyes) = guard(modes=("hung", "ok"), **FAST_WATCHDOG)
    box.watch()
    box.wait(lambda: "systemctl kill --signal=SIGKILL vllm-hands.service" in box.calls_made(), 15, "the kill")
    (alert,) = box.wait(lambda: box.webhook_alerts(), 20, "the alert")
    assert alert["event"] == "hung" and alert["engine"] == "hands"
    assert "answered none of 2 probes (/v1/completions, " in alert["message"]
    assert not any("vllm-eyes" in call and "kill" in call for call in box.calls_made())
    assert len(eyes.probes) >= 2


def test_engines_serving_from_a_removed_venv_are_told_once_as_ones_that_cannot_restart(guard):
    # hands is busy (its probes time out while it generates): looked at all the same.
    box, (hands, _) = guard(modes=("busy", "ok"), **FAST_WATCHDOG)
    python = Path(json.loads(box.config_path.read_text())["engines"][0]["python"])  # both engines'
    python.unlink()
    box.watch()
    told = box.wait(lambda: len(box.webhook_alerts()) == 2 and box.webhook_alerts(), 20, "an alert per engine")
    assert {(a["event"], a["engine"]) for a in told} == {("cannot-restart", "hands"), ("cannot-restart", "eyes")}
    assert f"vllm-hands.service runs, but its python {python} is gone" in told[0]["message"] + told[1]["message"]
    assert all("the deploy installs its venv again: pyinfra INVENTORY deploy.py" in a["message"] for a in told)
    probes = len(hands.probes)
    box.wait(lambda: len(hands.probes) >= probes + 2, 20, "two more rounds")
    assert len(box.webhook_alerts()) == 2  # once, not every round
    python.touch()
    box.wait(lambda: any(f"{python} is there again" in e["MESSAGE"] for e in box.journal.read()), 20, "the python back")
    assert len(box.webhook_alerts()) == 2 and not any("kill" in call for call in box.calls_made())


def test_pooling_engine_is_probed_on_its_route_and_killed_only_if_it_hangs(guard):
    """An embedding engine answers no completion (404): probed on /v1/embeddings it serves, and is
    left alone; a reranker that stops answering /rerank is called hung, by that route."""
    embedder_only, reranker_only = ("/v1/embeddings",), ("/rerank",)
    box, (hands, eyes) = guard(
        modes=("hung", "ok"), serves=(reranker_only, embedder_only), kinds=("rerank", "embed"), **FAST_WATCHDOG
    )
    box.watch()
    (alert,) = box.wait(lambda: box.webhook_alerts(), 20, "the alert")
    assert alert["event"] == "hung" and alert["engine"] == "hands"
    assert "answered none of 2 probes (/rerank, " in alert["message"]
    box.wait(lambda: len(eyes.probes) >= 3, 20, "three probes of the embedder")
    assert set(eyes.probes) == {"/v1/embeddings"} and set(hands.probes) == {"/rerank"}
    assert not any("vllm-eyes" in call and "kill" in call for call in box.calls_made())


def test_the_watchdog_leaves_a_busy_engine_whose_counters_move(guard):
    box, (hands, _) = guard(modes=("busy", "ok"), **FAST_WATCHDOG)
    box.watch()
    box.wait(lambda: len(hands.probes) >= 4, 20, "four probes of the busy engine")
    assert not any("kill" in call for call in box.calls_made())
    assert any("busy, not hung" in e["MESSAGE"] for e in box.journal.read())


def test_the_watchdog_leaves_an_engine_that_is_not_started(guard):
    box, (hands, eyes) = guard(modes=("hung", "ok"), **FAST_WATCHDOG)
    box.set_state("vllm-hands.service", "activating")  # its start: the readiness helper's business
    box.watch()
    box.wait(lambda: len(eyes.probes) >= 4, 20, "four rounds (the serving engine's probes)")
    assert hands.probes == [] and not any("kill" in call for call in box.calls_made())


def test_memory_guard_stops_lower_priority_engine_and_restarts_even_failed(guard):
    box, _ = guard(memory_warn_gib=8.0, memory_critical_gib=4.0, memory_margin_gib=2.0)
    box.watch()
    box.set_available_gib(6)  # between the floors: a warning, nothing stopped
    box.wait(lambda: [a["event"] for a in box.webhook_alerts()] == ["memory-low"], 20, "the warning")
    box.set_available_gib(3)
    box.wait(lambda: "systemctl stop vllm-eyes.service" in box.calls_made(), 20, "eyes stopped")
    # A restart someone asked for meanwhile was refused for memory until the start limit was spent.
    box.set_state("vllm-eyes.service", "failed")
    time.sleep(1.5)  # still critical: the highest-priority engine is never stopped
    assert "systemctl stop vllm-hands.service" not in box.calls_made()
    # Back only with room for eyes itself: 8 (warning) + 2 (margin) + 2.25 (its 0.25 GiB pool
    # and the launch script's 2 GiB margin) = 12.25 GiB.
    box.set_available_gib(12)
    time.sleep(1)
    assert "systemctl start --no-block vllm-eyes.service" not in box.calls_made()
    box.set_available_gib(12.5)
    box.wait(lambda: "systemctl start --no-block vllm-eyes.service" in box.calls_made(), 20, "eyes started")
    calls = box.calls_made()  # out of its failed state first: a spent start limit refuses the start
    start = calls.index("systemctl start --no-block vllm-eyes.service")
    assert calls[start - 1] == "systemctl reset-failed vllm-eyes.service"
    # The alert follows the start: on a loaded machine a moment later.
    expected = [("memory-low", "-"), ("memory-critical", "eyes"), ("memory-recovered", "eyes")]
    box.wait(lambda: len(box.webhook_alerts()) >= len(expected), 20, "the memory-recovered alert")
    assert [(a["event"], a["engine"]) for a in box.webhook_alerts()] == expected


def test_engines_target_restarts_once_every_engine_serves_only_if_enabled(guard):
    box, (hands, _) = guard(**FAST_WATCHDOG)
    target = "sparkform-engines.target"
    start = f"systemctl start --no-block {target}"

    def rounds(count: int) -> None:  # the guard's rounds, counted by its probes of hands
        seen = len(hands.probes)
        box.wait(lambda: len(hands.probes) >= seen + count, 20, f"{count} more rounds")

    box.set_state(target, "inactive")  # an engine's restart took it down (it is Requisite= of them)
    box.set_state(f"{target}.enabled", "disabled")
    box.watch()
    rounds(3)  # every engine serves, but nobody enabled the target
    assert start not in box.calls_made()
    box.set_state("vllm-eyes.service", "activating")  # eyes starts again meanwhile
    box.set_state(f"{target}.enabled", "enabled")
    rounds(3)
    assert start not in box.calls_made()
    box.set_state("vllm-eyes.service", "active")
    box.wait(lambda: start in box.calls_made(), 15, "the target started again")
    box.set_state(target, "active")
    (entry,) = box.wait(
        lambda: [e for e in box.journal.read() if e.get("SPARKFORM_EVENT") == "target-reached"], 10, "the journal line"
    )
    assert entry["MESSAGE"] == f"sparkform-guard: every engine serves again: {target} started again"
    assert box.webhook_alerts() == []  # a heal's last step, not news: the engines' own alerts said it


def test_a_rank_that_lost_its_head_restarts_and_joining_resets_start_count(guard):
    """eyes runs here as a rank for a head elsewhere (a real TCP listener on loopback stands in for
    the head's master port): joined, its start count is reset once; when the head closes the
    connection (vLLM's rank then sits in CLOSE-WAIT forever), the guard restarts the rank and says so."""
    box, _ = guard(**FAST_WATCHDOG)
    head = socket.create_server(("127.0.0.1", 0))
    settings = json.loads(box.config_path.read_text())
    rank = next(engine for engine in settings["engines"] if engine["name"] == "eyes")
    rank["head"] = ["127.0.0.1", head.getsockname()[1]]
    box.config_path.write_text(json.dumps({**settings, "rank_join_s": 0}))
    # The rank's main process: its command line names sparkform-vllm-serve, as vLLM's own CLI run does.
    main = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", settings["vllm_cli"]])
    replace_text(box.states / "vllm-eyes.service.pid", f"{main.pid}\n")
    store = socket.create_connection(head.getsockname())
    accepted, _ = head.accept()
    try:
        box.watch()
        box.wait(lambda: "systemctl reset-failed vllm-eyes.service" in box.calls_made(), 10, "the join's reset")
        time.sleep(3)
        assert "systemctl restart vllm-eyes.service" not in box.calls_made()  # joined: left alone
        assert not [c for c in box.calls_made() if "hands" in c and ("restart" in c or "kill" in c)]
        accepted.close()  # the head goes: the rank's store connection half-closes
        box.wait(lambda: "systemctl restart vllm-eyes.service" in box.calls_made(), 10, "the rank's restart")
        (alert,) = box.wait(box.webhook_alerts, 10, "the head-lost alert")  # sent after the restart
        assert alert["event"] == "head-lost" and alert["engine"] == "eyes"
        assert f"127.0.0.1:{head.getsockname()[1]}" in alert["message"]
        assert box.calls_made().count("systemctl reset-failed vllm-eyes.service") == 1
    finally:
        main.kill()
        main.wait()
        store.close()
        head.close()


# --- the watchdog's decision, called directly ---------------------------------------------------


class Counters:
    """The token counters' sums an engine's /metrics gives, one per read (None: no answer)."""

    def __init__(self, *values: float | None):
        self.values, self.reads = list(values), 0

    def __call__(self) -> float | None:
        self.reads += 1
        return self.values.pop(0)


@pytest.mark.parametrize(
    ("probes", "counters", "verdicts"),
    [
        # Three failures in a row with the counters still: hung, on the third.
        ([False, False, False], [10.0, 10.0], ["waits", "waits", "hung"]),
        # A long prefill: the counters moved between the first failure and the limit.
        ([False, False, False], [10.0, 12.0], ["waits", "waits", "busy"]),
        # Counters that did not answer prove no progress.
        ([False, False, False], [None, None, 12.0], ["waits", "waits", "hung"]),
        ([False, False, False], [10.0, None], ["waits", "waits", "hung"]),
        # A first reading missed (a loaded engine's /metrics): progress counts from the next one.
        ([False, False, False], [None, 12.0, 13.0], ["waits", "waits", "busy"]),
        ([False, False, False], [None, 12.0, 12.0], ["waits", "waits", "hung"]),
        # An answer in between starts the count again: five failures, never three in a row.
        ([False, False, True, False, False], [1.0, 1.0], ["waits", "waits", "serves", "waits", "waits"]),
        # After a verdict the count starts again: the next failure is a first one.
        ([False, False, False, False], [5.0, 5.0, 5.0], ["waits", "waits", "hung", "waits"]),
    ],
)
def test_watchdog_calls_hung_only_after_its_probe_limit_without_progress(probes, counters, verdicts):
    judge = watchdog.HangJudge(3)
    read = Counters(*counters)
    assert [judge.judge(answered, read) for answered in probes] == verdicts
    assert read.values == []  # read at each first failure (while None, before the limit) and each limit


def test_a_start_forgets_the_failures_counted_before_it():
    judge = watchdog.HangJudge(2)
    assert judge.judge(False, lambda: 1.0) == "waits"
    judge.forget()  # what the watchdog does while the unit is not active
    assert judge.judge(False, lambda: 1.0) == "waits"
    assert judge.judge(False, lambda: 1.0) == "hung"


def test_unplanned_stop_alerts_once_per_outage_and_recovery_says_downtime(guard):
    box, _ = guard()
    stop = {**box.env, "SERVICE_RESULT": "signal", "EXIT_CODE": "killed", "EXIT_STATUS": "KILL"}
    for _ in range(2):  # killed, then its restart failed: one outage, one alert
        result = subprocess.run(
            [sys.executable, str(box.script), "stopped", "hands"], env=stop, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
    (stopped,) = box.webhook_alerts()
    assert stopped["event"] == "stopped" and stopped["engine"] == "hands"
    assert "without a stop anyone asked for: signal SIGKILL" in stopped["message"]
    assert any("stopped again, still dark since" in e["MESSAGE"] for e in box.journal.read())
    assert box.run("served", "hands").returncode == 0
    stopped, recovered = box.webhook_alerts()
    assert recovered["event"] == "recovered" and "serves again after" in recovered["message"]
    assert "s dark (since" in recovered["message"] and "signal SIGKILL" in recovered["message"]
    box.run("served", "hands")  # a start that served with no outage open says nothing
    assert len(box.webhook_alerts()) == 2


def writes_fail() -> None:
    """In a child: every write of a byte to a file fails (EFBIG), as on a full disk; SIGXFSZ ignored,
    so the write fails instead of killing it."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))


def test_a_file_replaced_whole_stays_as_it_was_when_the_write_fails(tmp_path):
    target = tmp_path / "state.json"
    target.write_text("old\n")
    code = "import sys; from sparkform.host.whole_files import replaced; replaced(sys.argv[1], 'new')"
    result = subprocess.run(
        [sys.executable, "-c", code, str(target)], preexec_fn=writes_fail, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1 and "File too large" in result.stderr, result.stderr
    assert target.read_text() == "old\n" and os.listdir(tmp_path) == ["state.json"]  # no temp file left


@contextlib.contextmanager
def full_disk_at(folder: Path):
    """`folder` on a filesystem of its own (a 16 KiB tmpfs mounted over it, as root), filled to its
    last byte: a write there fails with ENOSPC; unmounted afterwards."""
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k,mode=0700", "tmpfs", str(folder)], check=True)
    try:
        with contextlib.suppress(OSError), open(folder / "filler", "wb") as filler:
            while True:
                filler.write(b"x" * 4096)
                filler.flush()
        yield
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_guard_whose_disk_is_full_tells_the_stop_and_watches_on(guard):
    """The guard's state folder full: an engine's stop is still alerted, its outage kept on tmpfs
    and closed by its "serves again"; the daemon alerts its failed heartbeat once (`disk-full`, with the free bytes) and
    keeps watching; no temp file is left; the first heartbeat written again is `disk-recovered`."""
    box, _ = guard()
    stop = {**box.env, "SERVICE_RESULT": "signal", "EXIT_CODE": "killed", "EXIT_STATUS": "KILL"}
    with full_disk_at(box.state_dir):
        result = subprocess.run(
            [sys.executable, str(box.script), "stopped", "hands"], env=stop, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
        (stopped,) = box.webhook_alerts()
        assert stopped["event"] == "stopped" and stopped["engine"] == "hands"
        spare = json.loads(box.config_path.read_text())["outage_spare_dir"]
        assert any(f"the outage of vllm-hands.service is kept in {spare}" in e["MESSAGE"] for e in box.journal.read())
        # Its start serves: the outage kept on tmpfs closes with its alert.
        served = box.run("served", "hands")
        assert served.returncode == 0, served.stderr
        (recovered,) = [a for a in box.webhook_alerts() if a["event"] == "recovered"]
        assert (
            recovered["message"].startswith("vllm-hands.service serves again after ")
            and " s dark (since " in (recovered["message"])
        )
        assert os.listdir(spare) == []
        box.watch()
        box.wait(
            lambda: [e for e in box.journal.read() if e["MESSAGE"].startswith("sparkform-guard: watching")],
            20,
            "the guard watching",
        )
        (full,) = box.wait(lambda: [a for a in box.webhook_alerts() if a["event"] == "disk-full"], 10, "disk-full")
        assert f"cannot write in {box.state_dir} (No space left on device; " in full["message"]
        assert "bytes free there): it watches on" in full["message"]
        assert box.daemon.poll() is None
        left = {str(path.relative_to(box.state_dir)) for path in box.state_dir.rglob("*")}
        assert left <= {"alerts.lock", "filler", "outbox"}, left  # no temp file
        box.daemon.kill()
        box.daemon.wait()
    # The next heartbeat that is written again says so, once.
    config = json.loads(box.config_path.read_text())
    assert outages.heartbeat(config, failing=True) is False and outages.heartbeat(config, failing=False) is False
    assert [a["event"] for a in box.webhook_alerts()].count("disk-recovered") == 1


def test_a_thread_that_dies_ends_the_guard_and_the_next_one_says_why(guard):
    """A watchdog thread that raises (here: an engine's settings without a probe) would leave that
    engine unwatched behind an active unit: the guard exits 1 at once, naming the thread and the
    exception, for systemd to start it again; the next guard's alert quotes it."""
    box, _ = guard(**FAST_WATCHDOG)
    settings = json.loads(box.config_path.read_text())
    del settings["engines"][0]["probe"]
    box.config_path.write_text(json.dumps(settings))
    box.watch()
    assert box.daemon is not None and box.daemon.wait(30) == 1
    said = "its watchdog hands thread died (KeyError: 'probe')"
    assert any(said in e["MESSAGE"] and e["PRIORITY"] == "2" for e in box.journal.read()), box.journal.read()
    heartbeat = json.loads((box.state_dir / "guard-alive.json").read_text())
    assert heartbeat["clean"] is False and heartbeat["why"] == said
    before = len(box.webhook_alerts())
    outages.after_start(settings)
    (restarted,) = box.webhook_alerts()[before:]
    assert restarted["event"] == "guard-restarted" and f"the guard died: {said} (last alive at" in restarted["message"]


def test_a_repeating_alert_is_folded_into_one_with_its_count(guard):
    """The same event of the same engine FLOOD_AFTER times within FLOOD_WINDOW_S (a guard in a
    restart loop): the last of those says the next are folded; they reach the journal and the
    counts but not the webhook, until the window passes without one: then one alert says how many.
    Another engine's alerts are their own."""
    box, _ = guard()
    config = json.loads(box.config_path.read_text())
    start = time.time()
    for n in range(alerts.FLOOD_AFTER + 2):
        alerts.alert(config, "stopped", "hands", f"crash {n}")
    alerts.alert(config, "stopped", "eyes", "crash of the other engine")
    sent = [(a["engine"], a["message"]) for a in box.webhook_alerts()]
    assert [m for e, m in sent if e == "hands"][:-1] == [f"crash {n}" for n in range(alerts.FLOOD_AFTER - 1)]
    assert sent[alerts.FLOOD_AFTER - 1][1].startswith(f"crash {alerts.FLOOD_AFTER - 1} ({alerts.FLOOD_AFTER} such")
    assert sent[-1] == ("eyes", "crash of the other engine") and len(sent) == alerts.FLOOD_AFTER + 1
    journaled = [e["MESSAGE"] for e in box.journal.read() if e.get("SPARKFORM_EVENT") == "stopped"]
    assert len(journaled) == alerts.FLOOD_AFTER + 3  # each one
    alerts.unfold(config, start + alerts.FLOOD_WINDOW_S - 5)  # not quiet yet
    assert len(box.webhook_alerts()) == alerts.FLOOD_AFTER + 1
    alerts.unfold(config, time.time() + alerts.FLOOD_WINDOW_S)
    (summary,) = box.webhook_alerts()[alerts.FLOOD_AFTER + 1 :]
    assert summary["event"] == "stopped" and summary["engine"] == "hands"
    assert summary["message"].startswith("2 more stopped alerts of hands were folded since ")
    alerts.alert(config, "stopped", "hands", "a crash after the quiet")  # a fresh count
    assert box.webhook_alerts()[-1]["message"] == "a crash after the quiet"
    # A state file of another shape is no flood and raises nothing: the alert goes out.
    (box.state_dir / "alert-floods.json").write_text(json.dumps({"stopped eyes": {"times": 7, "folded": 1}}))
    alerts.alert(config, "stopped", "eyes", "after a mangled state")
    alerts.unfold(config, time.time() + alerts.FLOOD_WINDOW_S)
    assert [a["message"] for a in box.webhook_alerts()[-2:]][0] == "after a mangled state"


def test_reboot_since_last_heartbeat_is_alerted_even_with_the_same_boot_id(guard):
    """The guard's start reads its last heartbeat: a reboot (the kernel's boot ID, or PID 1's start:
    a sandbox's reboot keeps the host kernel's ID, bench/chaos 2026-12-04) is `rebooted` after a
    clean stop and `unclean-reboot` without; the same boot without a clean stop is a guard that
    died; a clean stop of this boot says nothing."""
    box, _ = guard()
    config = json.loads(box.config_path.read_text())
    kernel, pid1 = outages.boot_id(), outages.pid1_start()
    assert isinstance(pid1, int)
    heartbeats = [
        ({"boot": kernel, "pid1": pid1 + 1, "clean": True}, "rebooted"),
        ({"boot": "an-older-boot", "clean": False}, "unclean-reboot"),  # a heartbeat of before pid1 was kept
        ({"boot": kernel, "pid1": pid1, "clean": False}, "guard-restarted"),
        ({"boot": kernel, "pid1": pid1, "clean": True}, None),
    ]
    for heartbeat, event in heartbeats:
        before = len(box.webhook_alerts())
        (box.state_dir / "guard-alive.json").write_text(json.dumps({**heartbeat, "time": time.time() - 60}))
        outages.after_start(config)
        told = [a["event"] for a in box.webhook_alerts()[before:]]
        assert told == ([event] if event else []), (heartbeat, told)
    outages.alive(config)
    assert json.loads((box.state_dir / "guard-alive.json").read_text())["pid1"] == pid1


def test_an_alert_the_webhook_did_not_take_is_kept_and_sent_again_in_order(guard):
    box, _ = guard(outbox_first_s=0.5)
    port = box.webhook.server_address[1]
    box.webhook.shutdown()
    box.webhook.server_close()
    for n in (1, 2):
        assert box.run("alert", "drift", "-", f"change {n}").returncode == 0
    assert len(list((box.state_dir / "outbox").glob("*.json"))) == 2
    box.webhook = make_server("127.0.0.1", port, box.root / "webhook.jsonl")
    threading.Thread(target=box.webhook.serve_forever, daemon=True).start()
    box.watch()
    sent = box.wait(lambda: len(box.webhook_alerts()) == 2 and box.webhook_alerts(), 20, "the kept alerts")
    assert [a["message"] for a in sent] == ["change 1", "change 2"]
    # Taken off the outbox once the webhook's answer is in: a moment after the receiver has it.
    box.wait(lambda: not list((box.state_dir / "outbox").glob("*.json")), 10, "the outbox emptied")


def test_the_front_probe_keeps_the_last_key_read_while_the_key_file_is_gone(guard, tmp_path):
    """The owner removes the front's key file: nginx's reload fails and it keeps the keys it loaded,
    so the guard's probe goes on with the key it last read (no false front-down), and says once
    what is missing; a new file's key is taken as soon as it is there."""
    box, _ = guard()
    key_file = tmp_path / "front-clients.conf"
    config = {**json.loads(box.config_path.read_text()), "front_key": str(key_file)}
    key_file.write_text(clients_snippet({"agents": "first-key-0123456789"}))
    known = KnownKey(config)
    assert known.read() == "first-key-0123456789"
    key_file.unlink()
    assert known.read() == known.read() == "first-key-0123456789"
    said = [e["MESSAGE"] for e in box.journal.read() if "key file" in e["MESSAGE"]]
    assert len(said) == 1 and f"the front's key file {key_file} is gone" in said[0], said
    key_file.write_text(clients_snippet({"agents": "second-key-0123456789"}))
    assert known.read() == "second-key-0123456789"
    assert f"the front's key file {key_file} is back" in box.journal.read()[-1]["MESSAGE"]


def test_front_passing_nothing_to_a_serving_engine_alerts_down_and_up(guard):
    front = GuardedFront("hung")  # nginx in a restart loop: nothing answers in time
    box, _ = guard(front=front, **FAST_WATCHDOG)
    box.watch()
    (down,) = box.wait(lambda: box.webhook_alerts(), 30, "the front-down alert")
    assert down["event"] == "front-down" and f"port(s) {front.port} (eyes)" in down["message"]
    front.mode = "ok"
    box.wait(lambda: len(box.webhook_alerts()) == 2, 30, "the front-recovered alert")
    assert box.webhook_alerts()[1]["event"] == "front-recovered"


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 100_000 + b"]" * 100_000,  # nested past the decoder's bound: RecursionError
        b'{"choices": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        json.dumps({"choices": [{"text": "x" * watchdog.PROBE_ANSWER_BYTES}]}).encode(),  # over the bound
        b'["choices"]',
        b'{"choices": "pong"}',
    ],
    ids=["nested", "nested-answer", "oversized", "a-list", "not-a-list"],
)
def test_a_hostile_probe_answer_fails_the_probe_never_the_guard(body, socket_dir):
    """Root's guard reads what the engine, the process that parses untrusted prompts, answers: a
    deeply nested answer raising a RecursionError would end the engine's watchdog thread, and
    an unbounded one would take the guard's memory."""
    engine = StubEngine(lambda request: Reply(body=body), path=engine_socket(socket_dir, "q38"))
    try:
        spec = {"route": "/v1/completions", "body": {"prompt": "ping", "max_tokens": 1}, "answer": "choices"}
        assert watchdog.probe({"socket": str(engine.socket), "probe": spec}, 10) is False
        # The same engine's fair answer passes: the probe itself is not what fails.
        engine.answer = lambda request: json_reply(PROBE_ANSWERS["/v1/completions"])
        assert watchdog.probe({"socket": str(engine.socket), "probe": spec}, 10) is True
        assert engine.paths("POST") == ["/v1/completions"] * 2
    finally:
        engine.close()


FAIR_ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 9\r\n\r\nvllm:x 1\n"


def chunked(size: bytes) -> bytes:
    """The fair answer sent chunked, its one chunk said to hold `size` (hex) bytes, and cut there."""
    return FAIR_ANSWER.replace(b"Content-Length: 9", b"Transfer-Encoding: chunked").replace(b"vllm", size + b"\r\nvllm")


@pytest.mark.parametrize(
    "hostile",
    [
        pytest.param(b"HTTP/1.1 banana\r\n\r\n", id="bad-status-line"),
        pytest.param(b"", id="closed-at-once"),  # the request read, the connection closed
        pytest.param(b"HTTP/1.1 200 OK\r\nX-" + b"a" * 70_000 + b": 1\r\n\r\n", id="header-over-the-bound"),
        pytest.param(chunked(b"40"), id="closed-mid-chunk"),
        pytest.param(chunked(b"zz"), id="chunk-size-not-a-number"),
        pytest.param(chunked(b"-5"), id="chunk-size-negative"),
        pytest.param(chunked(b"-1"), id="chunk-size-minus-one"),  # http.client: "read to the end"
    ],
)
def test_an_engine_that_answers_no_http_is_none_never_an_exception(hostile, socket_dir):
    """engine_api.answer is how root reads the engine, the process that parses untrusted prompts:
    whatever comes back on its socket, the caller (a watchdog thread) gets None, never an exception."""
    path = socket_dir / "api.sock"
    server = raw_answer_once(path, hostile)
    assert engine_api.answer(str(path), "/metrics", 5, 1024) is None
    server.join(10)
    path.unlink()
    # The same exchange with a well-formed answer is read: the hostile bytes are what fails.
    server = raw_answer_once(path, FAIR_ANSWER)
    assert engine_api.answer(str(path), "/metrics", 5, 1024) == (200, b"vllm:x 1\n")
    server.join(10)


@pytest.mark.parametrize("kind", ["fifo-with-a-writer", "fifo", "folder", "link"])
def test_a_launch_state_that_is_no_plain_file_reads_as_unknown(kind, tmp_path):
    """The engine user writes its launch state; root's guard reads it. A FIFO there fails a read
    that would block (EAGAIN), which must not end a guard thread; a link is never followed."""
    state = tmp_path / "q38.state"
    held = None
    if kind.startswith("fifo"):
        os.mkfifo(state)
        if kind == "fifo-with-a-writer":
            held = os.open(state, os.O_RDWR | os.O_NONBLOCK)  # a writer that never writes
    elif kind == "folder":
        state.mkdir()
    else:
        (tmp_path / "elsewhere").write_text("loading\n")
        state.symlink_to(tmp_path / "elsewhere")
    try:
        assert starts.launch_state(str(tmp_path), "q38") == ""
    finally:
        if held is not None:
            os.close(held)
    (tmp_path / "nemotron.state").write_text("loading\n")
    assert starts.launch_state(str(tmp_path), "nemotron") == "loading"
