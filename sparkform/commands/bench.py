"""`sparkform bench INVENTORY`: the pair measured on its host, each engine alone while the others
idle, then all at once with the same settings (sparkform/reports/bench.py: the generator, the figures).

Runs over SSH on the host, as the engine user, against each engine's own socket: nothing of
the API key is needed, and the LAN is not in the figures. Appends the result to the host's bench
ledger (root's record folder) and prints it with the ledger's history; `--plot FILE.png` draws
both. The phases of a host run one after the other; every phase stops after --timeout seconds.

Exit codes: 0 every host benched, its row appended and read back; 1 a host did not answer, an
engine was busy, a generator failed or ran out of time, or the ledger could not be written (the
host and engine named in one line); 2 the inventory is invalid or the settings do not fit an
engine (before any connection).
"""

from __future__ import annotations

import argparse
import math
import shlex
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sparkform.commands import hostpins, ssh
from sparkform.domain.layout import engine_curl, record_dir
from sparkform.domain.model import Host
from sparkform.readers.parsers import parse_prometheus
from sparkform.readers.remote import plain_file, section, split_sections
from sparkform.reports.bench import (
    PHASE_SLACK_S,
    TOGETHER,
    BenchError,
    BenchRow,
    Figures,
    Settings,
    combine,
    phase_command,
    read_ledger,
    read_phase,
    seed,
    settings_problems,
    utc_date,
)
from sparkform.reports.bench_table import format_history, format_row
from sparkform.rules.inventory import INVENTORY_HELP, load_inventory, raw_inventory

EXIT_USAGE = 2
# Requests an engine has in flight or queued: any, and its "alone" figure is not one.
BUSY_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")
# The guard's one-token probe may be in flight at one read, hardly at three a second apart.
IDLE_READS = 3


def busy_command(host: Host) -> str:
    """Each engine's requests in flight and queued, from its /metrics, one section per engine."""
    pattern = shlex.quote(f"^({'|'.join(BUSY_METRICS)})[{{ ]")
    return " ; ".join(
        section(
            engine.name,
            f"curl -sS -m 5 {engine_curl(host.config.engine_socket(engine), '/metrics')} | grep -E {pattern}",
        )
        for engine in host.config.enabled_engines
    )


def busy(output: str) -> dict[str, int]:
    """Engine -> requests it is serving or queueing now, for the engines that have any."""
    sections, _ = split_sections(output.splitlines())
    counts = {
        name: int(sum(s.value for s in parse_prometheus(lines) if math.isfinite(s.value) and s.value > 0))
        for name, lines in sections.items()
    }
    return {name: count for name, count in counts.items() if count}


def append_command(host: Host) -> str:
    """Append stdin's row to the ledger: root's, in the record folder a converge made; never
    through a symbolic link."""
    folder, ledger = shlex.quote(record_dir(host.config.state_dir)), shlex.quote(host.config.paths.bench_ledger)
    return (
        f"if [ ! -d {folder} ]; then echo 'no record folder {folder}: converge the host first' >&2; exit 3; fi; "
        f"if [ -L {ledger} ]; then echo '{ledger} is a symbolic link' >&2; exit 3; fi; "
        f"umask 022; cat >> {ledger}"
    )


class Remote:
    """One host over SSH, each failure a BenchError that names it."""

    def __init__(self, host: Host, data: dict[str, Any], folder: Path):
        self.host, self.data, self.folder = host, data, folder
        self.config = ssh.write_config(host.name, data, folder)

    def run(self, command: str, timeout: float, what: str, stdin: str | None = None) -> str:
        try:
            result = ssh.run(self.config, self.host.name, command, timeout=timeout, stdin=stdin)
        except subprocess.TimeoutExpired:
            raise BenchError(f"{self.host.name}: {what}: no answer within {timeout:.0f} s") from None
        if result.returncode == 255:
            raise BenchError(f"{self.host.name}: does not answer over SSH ({ssh.failure(result)})")
        if result.returncode:
            raise BenchError(f"{self.host.name}: {what}: {ssh.failure(result)}")
        return result.stdout


def tokenizers(remote: Remote) -> dict[str, str]:
    """Engine -> its checkpoint folder on the host (the generator's tokenizer), with the commits
    the host pinned for branches and tags."""
    host = remote.host
    config = host.config
    if hostpins.unpinned(config):  # a branch or tag: the host recorded which commit it serves
        answer = hostpins.ask(host.name, remote.data, config, remote.folder)
        if answer.why_not:
            raise BenchError(f"{host.name}: {answer.why_not}")
        config = hostpins.pinned(config, answer)
    missing = [e.name for e in hostpins.unpinned(config) if e.enabled]
    if missing:
        raise BenchError(
            f"{host.name}: engine {missing[0]}: the host records no commit for its checkpoint "
            "(not converged yet?): converge it first"
        )
    return {engine.name: config.checkpoint_dir(engine) for engine in config.generating_engines}


def bench_host(remote: Remote, settings: Settings) -> BenchRow:
    """Every phase of every run on one host; the row of its ledger."""
    host, engines = remote.host, remote.host.config.generating_engines
    folders = tokenizers(remote)
    for _ in range(IDLE_READS):
        working = busy(remote.run(busy_command(host), PHASE_SLACK_S, "reading the engines' /metrics"))
        if not working:
            break
        time.sleep(1)
    else:
        name, count = next(iter(working.items()))
        raise BenchError(
            f"{host.name}: engine {name} has {count} requests in flight or queued: the figures need the pair to "
            "themselves; bench when it idles"
        )
    runs = []
    for run in range(settings.runs):
        phases: dict[str, dict[str, Figures]] = {}
        for number, group in enumerate([[e] for e in engines] + [engines]):
            phase = TOGETHER if len(group) > 1 else group[0].name
            label = "all together" if len(group) > 1 else f"{phase} alone"
            print(f"{host.name}: run {run + 1}/{settings.runs}: {label}", flush=True)
            output = remote.run(
                phase_command(host.config, group, folders, settings, seed(run, number)),
                settings.timeout_s + PHASE_SLACK_S,
                f"phase {phase}",
            )
            phases[phase] = read_phase(host.name, phase, [e.name for e in group], output, settings)
        runs.append(phases)
    # The vLLMs the measured engines run, each once (an engine may run its own: engines[].vllm_version).
    vllm = "+".join(dict.fromkeys(host.config.pin(engine).label for engine in engines))
    return combine(utc_date(datetime.now(UTC)), vllm, settings, runs)


def ledger(remote: Remote, row: BenchRow) -> tuple[list[BenchRow], list[str]]:
    """Append the row to the host's ledger, then read the whole ledger back, checked."""
    path = remote.host.config.paths.bench_ledger
    remote.run(append_command(remote.host), PHASE_SLACK_S, f"appending to {path}", stdin=row.to_json() + "\n")
    output = remote.run(section("ledger", plain_file(path)), PHASE_SLACK_S, f"reading {path}")
    sections, links = split_sections(output.splitlines())
    if links:
        raise BenchError(f"{remote.host.name}: {path} is a symbolic link, where sparkform writes a plain file")
    return read_ledger("\n".join(sections.get("ledger", [])), f"{remote.host.name}:{path}")


def run(args: argparse.Namespace) -> int:
    settings = Settings(args.input_len, args.output_len, args.concurrency, args.requests, args.runs, args.timeout)
    hosts = [h for h in load_inventory(args.inventory) if args.host in (None, h.name)]
    if not hosts:
        print(f"sparkform bench: {args.inventory} has no host {args.host!r}", file=sys.stderr)
        return EXIT_USAGE
    if args.plot and len(hosts) > 1:
        print("sparkform bench: --plot draws one host: choose it with --host", file=sys.stderr)
        return EXIT_USAGE
    problems = []
    for h in hosts:
        if len(h.config.generating_engines) < 2:
            problems.append(
                f"{h.name}: {len(h.config.generating_engines)} enabled generating engine(s): co-residency needs two"
            )
        problems += [f"{h.name}: {problem}" for problem in settings_problems(h.config, settings)]
    if problems:
        print("\n".join(f"sparkform bench: {problem}" for problem in problems), file=sys.stderr)
        return EXIT_USAGE
    raw = raw_inventory(args.inventory)
    failed = False
    with tempfile.TemporaryDirectory(prefix="sparkform-bench-") as folder:
        for h in hosts:
            print(f"{h.name}: {settings.describe(len(h.config.generating_engines))}", flush=True)
            for engine in h.config.enabled_engines:
                if engine.pooling:
                    print(f"{h.name}: engine {engine.name} ({engine.kind}): not measured, bench times generation")
            try:
                remote = Remote(h, raw[h.name], Path(folder))
                row = bench_host(remote, settings)
                rows, untrusted = ledger(remote, row)
                if args.plot:
                    from sparkform.reports.bench_plot import plot

                    plot(args.plot, h.name, rows)
            except BenchError as err:
                print(f"sparkform bench: {err}", file=sys.stderr)
                failed = True
                continue
            for line in untrusted:
                print(f"sparkform bench: {line}", file=sys.stderr)
            print(f"\n{format_row(h.name, row)}\n\n{format_history(h.name, rows)}")
            if args.plot:
                print(f"\n{args.plot}: alone and together per engine, and the ledger's history")
    return 1 if failed else 0


def positive(text: str) -> int:
    """An argparse type: a whole number above 0."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a whole number above 0")
    return value


def add_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser(
        "bench", help="measure each engine alone, then all together: decode tok/s, TTFT, the co-residency penalty"
    )
    bench.add_argument("inventory", type=Path, nargs="?", help=INVENTORY_HELP)
    bench.add_argument("--host", help="only this host")
    bench.add_argument("--input-len", type=positive, default=256, help="prompt tokens per request (default 256)")
    bench.add_argument(
        "--output-len", type=positive, default=512, help="generated tokens per request, EOS ignored (default 512)"
    )
    bench.add_argument("--concurrency", type=positive, default=1, help="requests in flight per engine (default 1)")
    bench.add_argument("--requests", type=positive, default=3, help="requests per engine and phase (default 3)")
    bench.add_argument(
        "--runs", type=positive, default=1, help="times every phase runs; figures are medians (default 1)"
    )
    bench.add_argument(
        "--timeout", type=positive, default=600, help="seconds after which a phase's generators stop (default 600)"
    )
    bench.add_argument("--plot", type=Path, metavar="FILE.png", help="draw alone vs together and the ledger's history")
    bench.set_defaults(run=run)
