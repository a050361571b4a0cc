#!/usr/bin/env python3
"""Benchmark: the latency the front adds, side by side in one run, on a converged sandbox.

    bench/front.py [--requests 200] [--engine nemotron]

Needs a converged sandbox (`make sandbox`; SPARKFORM_SANDBOX picks another). On the host itself
(so no network stands between client and front), one client sends, in turn, a one-token chat
completion and a streamed one (8 tokens) to three places: the engine's own unix socket, the
front's port of that engine, and the combined port (front_port), the three
interleaved request by request so a slow moment of the machine falls on all three alike. Prints,
per place and kind, the median and p99 of the time to the whole answer and, for the streamed
one, of the time to its first event; then what each port of the front adds at the median over
the engine's own socket. Exit code 0, or 1 when a request failed.
"""

from __future__ import annotations

import argparse
import http.client
import inspect
import json
import os
import socket
import statistics
import sys
import time
import urllib.parse
from pathlib import Path

from sparkform.domain.schema import HostConfig
from sparkform.rules.inventory import load_inventory
from sparkform.sandbox import machine, stage

# The live tests' helpers (their sandbox inventory, their ssh) are no part of the package.
sys.path.append(str(Path(__file__).resolve().parent.parent / "tests" / "integration"))
from deploy_helpers import SANDBOX_INVENTORY, ssh  # noqa: E402


def timed(place: list[str | None], body: dict, key: str | None) -> list[float | None]:
    """[s to the first line of the answer, s to its end] of one request to `place`, [a unix
    socket to connect to or None, the URL]. Runs on the host by its source (the system's
    python3, standard library only)."""
    socket_path, url = place[0], str(place[1])
    parts = urllib.parse.urlsplit(url)
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    started = time.perf_counter()
    connection = http.client.HTTPConnection(parts.hostname or "localhost", parts.port, timeout=60)
    first = None
    try:
        if socket_path:  # http.client sends on a socket it already holds
            connection.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            connection.sock.settimeout(60)
            connection.sock.connect(socket_path)
        connection.request("POST", parts.path, json.dumps(body), headers)
        response = connection.getresponse()
        if response.status != 200:
            raise OSError(f"{url} answered {response.status}")
        for _ in response:
            first = first or time.perf_counter() - started
    finally:
        connection.close()
    return [first, time.perf_counter() - started]


def on_the_host(places: dict[str, list[str | None]], bodies: dict[str, dict], key: str, requests: int) -> str:
    """The program the host runs: every place and kind in turn, `requests` rounds; JSON out,
    {place: {kind: [[first, end], ...]}}. The key goes in the program on stdin, never in argv."""
    return f"""import http.client, json, socket, time, urllib.parse
{inspect.getsource(timed)}
places, bodies, key = {places!r}, {bodies!r}, {key!r}
times = {{place: {{kind: [] for kind in bodies}} for place in places}}
for _ in range({requests}):
    for place, url in places.items():
        for kind, body in bodies.items():
            times[place][kind].append(timed(url, body, None if place == "engine" else key))
print(json.dumps(times))"""


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) > 1 else values[0]


def requests_to(config: HostConfig, engine_name: str) -> tuple[dict[str, list[str | None]], dict[str, dict]]:
    """The three places the bench sends to for the engine ([unix socket or None, URL] each), and
    its two kinds of request (body each)."""
    engine = next(e for e in config.engines if e.name == engine_name)
    front = config.front_local_address
    places: dict[str, list[str | None]] = {
        "engine": [config.engine_socket(engine), "http://localhost/v1/chat/completions"],
        "own port": [None, f"http://{front}:{engine.port}/v1/chat/completions"],
        "combined": [None, f"http://{front}:{config.front_port}/v1/chat/completions"],
    }
    chat = {"model": engine.names[0], "messages": [{"role": "user", "content": "hi"}]}
    bodies = {"one token": chat | {"max_tokens": 1}, "streamed": chat | {"max_tokens": 8, "stream": True}}
    return places, bodies


def table(times: dict[str, dict[str, list[list[float]]]]) -> list[str]:
    """The lines printed of what the host measured: per place and kind, then what the front adds."""
    lines = [f"{'place':10} {'kind':10} {'median ms':>10} {'p99 ms':>8} {'first event: median ms':>23} {'p99 ms':>8}"]
    medians = {}
    for place, kinds in times.items():
        for kind, pairs in kinds.items():
            whole, first = [end for _, end in pairs], [start for start, _ in pairs]
            medians[(place, kind)] = statistics.median(whole) * 1000
            events = f"{statistics.median(first) * 1000:23.2f} {p99(first) * 1000:8.2f}" if kind == "streamed" else ""
            lines.append(f"{place:10} {kind:10} {medians[(place, kind)]:10.2f} {p99(whole) * 1000:8.2f} {events}")
    for kind in times["engine"]:
        own, combined, engine_ms = (medians[(place, kind)] for place in ("own port", "combined", "engine"))
        lines.append(
            f"added at the median, {kind}: the own port {own - engine_ms:+.2f} ms over the engine, "
            f"the combined port {combined - engine_ms:+.2f} ms over the engine and {combined - own:+.2f} ms "
            "over the own port"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--engine", default="nemotron")
    args = parser.parse_args()
    box = machine.get(os.environ.setdefault("SPARKFORM_SANDBOX", "sandbox"))
    (host,) = load_inventory(SANDBOX_INVENTORY)
    places, bodies = requests_to(host.config, args.engine)
    key = stage.secret_file(box.runtime_dir, "api_key").read_text().strip()
    result = ssh(box, "python3 -", stdin=on_the_host(places, bodies, key, args.requests), check=False)
    if result.returncode != 0:
        print(f"front bench: a request failed on the host:\n{result.stderr[-2000:]}", file=sys.stderr)
        return 1
    print(f"front bench: {args.requests} requests per place and kind, engine {args.engine}, sandbox {box.name}")
    print("\n".join(table(json.loads(result.stdout))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
