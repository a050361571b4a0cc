#!/usr/bin/env python3
"""Chaos run: the sandbox pair under a client loop while random faults land, for a bounded time.

    bench/chaos.py [--minutes 10] [--seed N] [--faults kill-one,kill-both,stop-api,...]

Needs a converged sandbox (`make sandbox`; SPARKFORM_SANDBOX picks another). A client per engine
sends a one-token chat completion through the front (with the key) every second; a fault lands
every 45-90 s:
  kill-one, kill-both   kill -9 of one or both EngineCores
  stop-api, stop-core   SIGSTOP of a serving API server or EngineCore (left stopped: the watchdog acts)
  stop-loading-api,     the engine restarted, then its API server or EngineCore stopped while it
  stop-loading-core     loads (the guard's start watch acts)
  kill-beside-start     one engine restarted, the other's EngineCore killed while it starts
  burst                 kill -9 of one EngineCore under a burst of 16 parallel client requests
  memory                memory taken outside the engines' cgroups under the critical floor for 60 s
                        (the guard's floors are set 3-3.5 GiB under what is free for the run)
  stop-guard            SIGSTOP of the guard (systemd's watchdog restarts it)
  front                 nginx's config broken and nginx killed, mended after 60 s
  reboot                a reboot of the whole host
The clients go on 150 s after the last fault's window. Prints, per fault, how long each engine
it darkened took to serve again against that fault's bound (one engine start as measured in
this run + 30 s, plus the stall bound for a stall, plus the time the memory and front faults
hold (60 s; the front's engines need no start) and what is left of such a hold when the fault
lands during one, plus one start for the engine that loads second when a fault restarts both:
the start lock keeps two loads apart) and whether an alert for it reached the receiver; then
the share of requests answered per engine beside the run's ceiling (1 - the dark time the
faults' own restarts must take), each engine's longest dark time, and the alerts. Every
request, fault and wait is bounded; the run ends by itself. Exit code: 0 when both engines
serve at the end and every fault kept its bound and was alerted, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path

from sparkform.domain.layout import FRONT_CONFIG, FRONT_UNIT, GUARD_UNIT
from sparkform.host.starts import STOPPED_S
from sparkform.sandbox import machine, stage
from sparkform.sandbox.alerts import read_alerts

# The live tests' helpers (their sandbox inventory, pyinfra, ssh, edited inventories) are no part of the package.
sys.path.append(str(Path(__file__).resolve().parent.parent / "tests" / "integration"))
from deploy_helpers import SANDBOX_INVENTORY, edited_inventory, pyinfra, ssh  # noqa: E402

ENGINES = {"nemotron": 8012, "q38": 8011}
LOWEST_PRIORITY = "q38"  # the engine the memory guard stops (inventory/sandbox.py's priorities)
FAULTS = (
    "kill-one", "kill-both", "stop-api", "stop-core", "stop-loading-api", "stop-loading-core", "kill-beside-start",
    "burst", "memory", "stop-guard", "front", "reboot",
)  # fmt: skip
STALLS = ("stop-api", "stop-core", "stop-loading-api", "stop-loading-core")
# What each fault's alert is called (any of them matches); "-": the host's.
FAULT_ALERTS = {
    "kill-one": ("stopped",), "kill-both": ("stopped",), "burst": ("stopped",), "kill-beside-start": ("stopped",),
    "stop-api": ("hung",), "stop-core": ("hung",), "stop-loading-api": ("stalled",), "stop-loading-core": ("stalled",),
    "memory": ("memory-critical", "memory-low"), "stop-guard": ("guard-restarted",), "front": ("front-down",),
    "reboot": ("rebooted", "unclean-reboot"),
}  # fmt: skip
# Faults that restart both engines at once: the second to load waits for the first.
SERIAL_STARTS = ("kill-both", "kill-beside-start", "reboot")
MEMORY_S = 60  # the memory fault holds its memory this long: the guard keeps q38 stopped meanwhile
FRONT_S = 60  # the front fault keeps nginx's config broken this long: no engine restarts
# How long a fault itself keeps an engine dark before anything can bring it back, and whether
# that engine must start again afterwards (the front's do not: they never stopped).
HELD_S = {"memory": MEMORY_S, "front": FRONT_S}
STALL_BOUND_S = 15 + STOPPED_S + 5  # a look every watchdog round (15 s) or 5 s while starting, then STOPPED_S
REQUEST_TIMEOUT_S = 30
SETTLE_S = 240  # after the run: how long both engines get to serve again
TAIL_S = 150  # the clients' requests after the faults stopped


class Client(threading.Thread):
    """One engine's request loop: (time, answered) per request."""

    def __init__(self, box: machine.Sandbox, engine: str, key: str, until: float):
        super().__init__(daemon=True)
        self.url = f"http://{box.address}:{ENGINES[engine]}/v1/chat/completions"
        self.engine, self.key, self.until = engine, key, until
        self.results: list[tuple[float, bool]] = []

    def run(self) -> None:
        body = json.dumps(
            {"model": self.engine, "max_tokens": 1, "messages": [{"role": "user", "content": "ping"}]}
        ).encode()
        while time.monotonic() < self.until:
            started = time.monotonic()
            request = urllib.request.Request(
                self.url, data=body, headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.key}"}
            )
            try:
                with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                    ok = response.status == 200
            except (OSError, urllib.error.HTTPError):
                ok = False
            self.results.append((started, ok))
            time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))

    def longest_dark_s(self) -> float:
        longest, dark_since = 0.0, None
        for at, ok in self.results:
            if not ok and dark_since is None:
                dark_since = at
            elif ok and dark_since is not None:
                longest, dark_since = max(longest, at - dark_since), None
        if dark_since is not None:
            longest = max(longest, self.results[-1][0] - dark_since)
        return longest


def main_pid(box: machine.Sandbox, engine: str) -> int:
    return int(ssh(box, f"systemctl show -p MainPID --value vllm-{engine}.service").stdout.strip() or 0)


def engine_core(box: machine.Sandbox, engine: str) -> int | None:
    pid = main_pid(box, engine)
    out = ssh(box, f"ps -o pid=,args= --ppid {pid} | awk '/EngineCore/ {{print $1; exit}}'", check=False).stdout
    return int(out) if pid and out.strip() else None


def loading_pid(box: machine.Sandbox, engine: str, core: bool, before: int, timeout_s: float = 60) -> int | None:
    """The engine's new API server (not `before`), or its EngineCore, once its launch exec'd vLLM."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pid = main_pid(box, engine)
        args = ssh(box, f"tr '\\0' ' ' < /proc/{pid}/cmdline", check=False).stdout if pid not in (0, before) else ""
        if "vllm.entrypoints" in args:
            found = engine_core(box, engine) if core else pid
            if found:
                return found
        time.sleep(0.2)
    return None


def burst(box: machine.Sandbox, key: str, engine: str) -> None:
    """16 parallel requests through the front, each bounded: the load a fault lands in."""
    body = json.dumps({"model": engine, "max_tokens": 64, "messages": [{"role": "user", "content": "tell me"}]})
    url = f"http://{box.address}:{ENGINES[engine]}/v1/chat/completions"
    for _ in range(16):
        request = urllib.request.Request(
            url, data=body.encode(), headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
        )
        threading.Thread(target=lambda r=request: _bounded(r), daemon=True).start()


def _bounded(request: urllib.request.Request) -> None:
    try:
        urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S).close()
    except (OSError, urllib.error.HTTPError):
        pass


def inject(box: machine.Sandbox, fault: str, rng: random.Random, key: str) -> tuple[str, list[str] | None]:
    """Land one fault; returns what it did and the engines it concerns, None when it found
    nothing to act on (an engine the memory guard holds stopped has no EngineCore to stop).
    Every command returns at once (a background one has no stdin: ssh waits for none of it)."""
    engine = rng.choice(sorted(ENGINES))
    other = next(e for e in ENGINES if e != engine)
    if fault in ("kill-one", "kill-both", "burst"):
        targets = sorted(ENGINES) if fault == "kill-both" else [engine]
        if fault == "burst":
            burst(box, key, engine)
            time.sleep(1)
        cores = [core for core in (engine_core(box, e) for e in targets) if core]
        if cores:
            ssh(box, f"kill -9 {' '.join(map(str, cores))}", check=False)
        under = " under a burst of 16 requests" if fault == "burst" else ""
        return (
            f"kill -9 of the EngineCore of {', '.join(targets)}{under} ({len(cores)} found)",
            targets if cores else None,
        )
    if fault in ("stop-api", "stop-core"):
        pid = main_pid(box, engine) if fault == "stop-api" else engine_core(box, engine)
        if pid:
            ssh(box, f"kill -STOP {pid}", check=False)
        what = "API server" if fault == "stop-api" else "EngineCore"
        return f"SIGSTOP of {engine}'s {what} (pid {pid}), left for the watchdog", [engine] if pid else None
    if fault in ("stop-loading-api", "stop-loading-core"):
        before = main_pid(box, engine)
        ssh(box, f"systemctl restart --no-block vllm-{engine}.service", check=False)
        pid = loading_pid(box, engine, core=fault == "stop-loading-core", before=before)
        if pid:
            ssh(box, f"kill -STOP {pid}", check=False)
        what = "EngineCore" if fault == "stop-loading-core" else "API server"
        return f"{engine} restarted and its {what} stopped while it loads (pid {pid})", [engine] if pid else None
    if fault == "kill-beside-start":
        before = main_pid(box, engine)
        ssh(box, f"systemctl restart --no-block vllm-{engine}.service", check=False)
        loading_pid(box, engine, core=False, before=before)
        core = engine_core(box, other)
        if core:
            ssh(box, f"kill -9 {core}", check=False)
        hit = [engine, other] if core else [engine]
        return f"{engine} restarted, {other}'s EngineCore (pid {core}) killed while {engine} starts", hit
    if fault == "memory":
        ssh(
            box,
            "setsid -f timeout 60 python3 -c 'import time; x = bytearray(5 * 2**30); time.sleep(60)' "
            "</dev/null >/dev/null 2>&1",
            check=False,
        )
        return "5 GiB taken outside the engines' cgroups for 60 s", [LOWEST_PRIORITY]
    if fault == "stop-guard":
        ssh(box, f"kill -STOP $(systemctl show -p MainPID --value {GUARD_UNIT})", check=False)
        return "SIGSTOP of the guard, left for systemd's watchdog", []
    if fault == "front":
        ssh(
            box,
            f"cp {FRONT_CONFIG} /root/chaos-front.conf && echo 'broken;' >> {FRONT_CONFIG} && "
            f"kill -9 $(systemctl show -p MainPID --value {FRONT_UNIT}) && "
            f"setsid -f bash -c 'sleep {FRONT_S}; cp /root/chaos-front.conf {FRONT_CONFIG}; "
            f"systemctl reset-failed {FRONT_UNIT}; systemctl restart {FRONT_UNIT}' </dev/null >/dev/null 2>&1",
            check=False,
        )
        return f"nginx's config broken and nginx killed, mended {FRONT_S} s later", sorted(ENGINES)
    machine.reboot(box.name)
    return "reboot of the whole host", sorted(ENGINES)


def back_after(client: "Client", at: float, until: float) -> float | None:
    """Seconds from `at` until the client's requests were answered again after the first that
    failed (0: none failed), None: not answered again before `until`."""
    failed = None
    for started, ok in client.results:
        if started < at or started >= until:
            continue
        if not ok and failed is None:
            failed = started
        elif ok and failed is not None:
            return started - at
    return 0.0 if failed is None else None


def start_seconds(box: machine.Sandbox) -> float:
    """The longest start (exec to readiness) the helpers logged this run: one engine start."""
    out = ssh(
        box,
        "journalctl -b --no-pager -o cat -u vllm-nemotron -u vllm-q38 | "
        "sed -n 's/^sparkform-wait-ready: port [0-9]* serves .* after \\([0-9]*\\) s$/\\1/p'",
        check=False,
    ).stdout.split()
    return max((float(n) for n in out), default=60.0)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The run's settings and its faults, in the order given; exit 2 on a fault it does not know."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--faults", default=",".join(FAULTS))
    args = parser.parse_args(argv)
    faults = [fault for fault in args.faults.split(",") if fault]
    unknown = set(faults) - set(FAULTS)
    if unknown or not faults:
        parser.error(f"unknown faults {sorted(unknown)}; choose from {', '.join(FAULTS)}")
    return args, faults


def plan(args: argparse.Namespace, faults: list[str], sandbox: str) -> str:
    return f"chaos: {args.minutes:g} min against sandbox {sandbox}, seed {args.seed}, faults {', '.join(faults)}"


def main() -> int:
    args, faults = parse_args()
    rng = random.Random(args.seed)
    box = machine.get(os.environ.setdefault("SPARKFORM_SANDBOX", "sandbox"))  # the inventory reads it too
    key = stage.secret_file(box.runtime_dir, "api_key").read_text().strip()
    alerts_before = len(read_alerts(stage.alerts_file(box.runtime_dir)))

    inventory = SANDBOX_INVENTORY
    if "memory" in faults:
        # Floors near what is free now, so 3 GiB taken crosses the critical one.
        free = int(ssh(box, "awk '/^MemAvailable:/ {print $2}' /proc/meminfo").stdout) / 2**20
        # Engines loading after a crash swing MemAvailable by 2-3 GiB here: floors further down.
        inventory = edited_inventory(
            Path(os.environ.get("TMPDIR", "/tmp")),
            host_changes={
                "memory_warn_gib": round(free - 3, 2),
                "memory_critical_gib": round(free - 3.5, 2),
                "memory_margin_gib": 0.0,
            },
        )
    assert pyinfra(inventory, "-y").returncode == 0, "the sandbox did not converge; run make sandbox first"

    print(plan(args, faults, box.name), flush=True)
    started = time.monotonic()
    until = started + args.minutes * 60
    # The clients go on TAIL_S past the last fault's window: a fault near the end is measured too.
    clients = [Client(box, engine, key, until + TAIL_S) for engine in ENGINES]
    for client in clients:
        client.start()
    injected: list[tuple[float, str, str, list[str]]] = []  # (monotonic time, fault, what it did, engines)
    while time.monotonic() + 45 < until:
        time.sleep(rng.uniform(45, 90))
        if time.monotonic() >= until:
            break
        fault = rng.choice(faults)
        at = time.monotonic()
        what, engines = inject(box, fault, rng, key)
        if engines is None:
            print(f"  {at - started:6.0f} s  {what}: found nothing to act on, not counted", flush=True)
            continue
        injected.append((at, fault, what, engines))
        print(f"  {at - started:6.0f} s  {what} (landed in {time.monotonic() - at:.0f} s)", flush=True)
    for client in clients:
        client.join(REQUEST_TIMEOUT_S + 5)

    deadline = time.monotonic() + SETTLE_S
    serving = False
    while time.monotonic() < deadline and not serving:
        states = ssh(box, "systemctl is-active vllm-nemotron vllm-q38 || true", check=False).stdout.split()
        serving = states == ["active", "active"]
        time.sleep(2)
    time.sleep(30)  # the last alerts ("serves again") on their way to the receiver

    one_start = start_seconds(box)
    received = read_alerts(stage.alerts_file(box.runtime_dir))[alerts_before:]
    wall_start = time.time() - (time.monotonic() - started)  # the receiver stamps alerts in unix time
    by_client = {c.engine: c for c in clients}
    kept, alerted = True, 0
    needed_dark: defaultdict[str, float] = defaultdict(float)  # per engine: the dark time the faults must take
    matched: set[int] = set()  # the alerts a fault took
    print(f"\none engine start this run: {one_start:.0f} s; per fault, each engine it darkened:")
    for n, (at, fault, _, engines) in enumerate(injected):
        backs = []
        restart = 0.0 if fault == "front" else one_start
        bound = restart + 30 + (STALL_BOUND_S if fault in STALLS else 0) + HELD_S.get(fault, 0)
        # Measured until each engine serves again; a later fault on it before then adds its bound.
        back_of = {engine: back_after(by_client[engine], at, until + TAIL_S) for engine in engines}
        back_or_never = {engine: float("inf") if back is None else back for engine, back in back_of.items()}
        # Two engines started together load one at a time (the start lock): the one back last
        # waited one start for the other.
        second = max(engines, key=back_or_never.__getitem__) if fault in SERIAL_STARTS and len(engines) > 1 else None
        for engine in engines:
            back, waited = back_of[engine], one_start if engine == second else 0.0
            later = [
                f for later, f, _, hit in injected[n + 1 :] if engine in hit and back is not None and later < at + back
            ]
            # Landed while an earlier fault still holds this engine dark (the memory guard keeps
            # q38 stopped, its launch refuses): nothing brings it back before that hold ends.
            held_left = max(
                [a + HELD_S[f] - at for a, f, _, hit in injected[:n] if engine in hit and f in HELD_S and a < at],
                default=0.0,
            )
            own = (
                bound
                + waited
                + max(0.0, held_left)
                + sum(one_start + 30 + (STALL_BOUND_S if f in STALLS else 0) for f in later)
            )
            fine = back is not None and back <= own
            kept &= fine
            if back:
                needed_dark[engine] += restart + waited + HELD_S.get(fault, 0)
            backs.append(
                f"{engine} {'not back' if back is None else f'{back:.0f} s'} (bound {own:.0f} s"
                f"{f', with {len(later)} later fault(s)' if later else ''}){'' if fine else ' OVER'}"
            )
        # Its alert: the first of its kind from the fault on, until the engines' bound (and a
        # minute for the receiver) has passed, that no earlier fault took.
        low, high = wall_start + (at - started) - 5, wall_start + (at - started) + bound + 60
        told = [
            a
            for a in received
            if a["alert"]["event"] in FAULT_ALERTS[fault]
            and low <= a["alert"].get("time", 0) < high
            and id(a) not in matched
            and (not engines or a["alert"]["engine"] in engines or a["alert"]["engine"] == "-")
        ][:1]
        matched.update(id(a) for a in told)
        alerted += bool(told)
        print(
            f"  {at - started:6.0f} s  {fault:18} {'; '.join(backs) or 'no engine darkened'}; "
            f"alert: {told[0]['alert']['event'] if told else 'NONE'}"
        )
    run_s = until + TAIL_S - started
    print("\nengine    requests  answered  ceiling  longest dark")
    for client in clients:
        answered = sum(ok for _, ok in client.results)
        share = answered / len(client.results) if client.results else 0.0
        ceiling = max(0.0, 1 - needed_dark[client.engine] / run_s)
        print(
            f"{client.engine:9} {len(client.results):8}  {share:8.1%}  {ceiling:7.1%}  {client.longest_dark_s():9.0f} s"
        )
    kinds = Counter(fault for _, fault, _, _ in injected)
    print(
        f"faults: {len(injected)} ({', '.join(f'{n} x {k}' for k, n in kinds.items())}); "
        f"{alerted} of {len(injected)} matched by an alert; every fault within its bound: {'yes' if kept else 'NO'}"
    )
    events = Counter(entry["alert"]["event"] for entry in received)
    print(f"alerts received: {len(received)} ({', '.join(f'{n} {e}' for e, n in sorted(events.items()))})")
    print(f"both serving at the end: {'yes' if serving else 'NO'} (seed {args.seed})")
    if inventory != SANDBOX_INVENTORY:  # the guard's floors back as the inventory says
        pyinfra(SANDBOX_INVENTORY, "-y")
    return 0 if serving and kept and alerted == len(injected) else 1


if __name__ == "__main__":
    sys.exit(main())
