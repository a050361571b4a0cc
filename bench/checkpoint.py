#!/usr/bin/env python3
"""Benchmark: checkpoint verification costs, on this machine against the fake hub (127.0.0.1).

    bench/checkpoint.py [--shards 4] [--shard-mib 256] [--rounds 3]

Prints: first-download throughput of sparkform-checkpoint (download + sha256 of every file,
fsync'd) next to a plain `curl` of the same bytes (one file after the other, and all at once with
--parallel), and their ratios; the bytes fetched again when a shard's download is cut at 90 %
(the script resumes it) and whether the result verified; the scrub's re-hash of the fetched
checkpoint at its default rate bound (and unbounded) against the bound; the no-op check's time for a checkpoint
of 22 GiB in 11 shards (the deploy trusts the manifest's size and mtime, it hashes nothing;
sparse files stand in for the bytes) and its cost per GiB.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sparkform.deploy.facts.snapshot import checkpoint_scan_command
from sparkform.domain.layout import CHECKPOINT_MANIFEST, COMPLETE_MARKER
from sparkform.domain.schema import HostConfig
from sparkform.host import settings_path
from sparkform.sandbox.fakehub import FakeHub
from sparkform.writers.programs import host_source, scrub_settings

REPO = "bench/weights"
GIB = 2**30


def make_repo(folder: Path, shards: int, shard_mib: int) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["Bench"]}))
    for index in range(shards):
        with open(folder / f"model-{index:05d}.safetensors", "wb") as out:
            for _ in range(shard_mib):
                out.write(os.urandom(2**20))
    return folder


def fetch_seconds(hub: FakeHub, work: Path, folder: Path, *options: str) -> tuple[float, float]:
    """Seconds sparkform-checkpoint takes in all, and from its first line (python started, the hub
    asked for the commit and the tree, the free space checked) to its end: the fetch itself."""
    script = work / "sparkform-checkpoint"
    script.write_text(host_source("checkpoint"))  # the program's module, run by path as the launcher runs it
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(work / "hf-home"))
    subprocess.run(["sync"], check=True)  # as before curl's runs: what the runs before wrote is not this one's
    started = time.monotonic()
    command = [sys.executable, str(script), REPO, "main", str(folder), *options]
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) as process:
        assert process.stdout is not None  # a pipe: stdout=PIPE
        process.stdout.readline()
        first_line = time.monotonic()
        process.stdout.read()
    if process.returncode != 0:
        raise SystemExit(f"sparkform-checkpoint failed with exit {process.returncode}")
    ended = time.monotonic()
    return ended - started, ended - first_line


def curl_seconds(hub: FakeHub, files: list[Path], work: Path, parallel: bool) -> tuple[float, float]:
    """Seconds curl takes to fetch `files` (one after the other, or all at once), and the seconds
    until its files are on disk too (fsync'd, as sparkform-checkpoint does before its marker)."""
    urls = [f"{hub.url}/{REPO}/resolve/main/{path.name}" for path in files]
    outputs = [str(work / f"curl-{index}.out") for index in range(len(files))]
    subprocess.run(["sync"], check=True)  # what the runs before left in the page cache is not this one's
    started = time.monotonic()
    if parallel:
        pairs = [arg for url, out in zip(urls, outputs, strict=True) for arg in ("-o", out, url)]
        # curl draws its meter for --parallel even with -s; it only says what the timing says
        subprocess.run(
            ["curl", "-fsS", "--parallel", "--parallel-max", str(len(files)), *pairs],
            check=True,
            stderr=subprocess.DEVNULL,
        )
    else:
        for url, out in zip(urls, outputs, strict=True):
            subprocess.run(["curl", "-fsS", "-o", out, url], check=True)
    fetched = time.monotonic() - started
    for out in outputs:
        with open(out, "rb") as handle:
            os.fsync(handle.fileno())
    on_disk = time.monotonic() - started
    for out in outputs:
        os.unlink(out)
    return fetched, on_disk


def scrub_seconds(work: Path, folder: Path, rate_mib_s: int) -> float:
    """Seconds sparkform-scrub --check-only takes to re-hash `folder` against its manifest at a
    read bound of `rate_mib_s` (it must find every file as recorded). Its settings are a default
    host's, in the file beside it (sparkform.host.settings_path), with this checkpoint alone."""
    script = work / "sparkform-scrub"
    script.write_text(host_source("scrub"))
    commit = (folder / COMPLETE_MARKER).read_text().strip()
    checkpoint = {"folder": str(folder), "repo": REPO, "commit": commit, "fetch": [], "engines": []}
    settings = scrub_settings(HostConfig()) | {
        "checkpoints": [checkpoint],
        "rate_mib_s": rate_mib_s,
        "repairs": str(work / "scrub-repairs.json"),
    }
    Path(settings_path(str(script))).write_text(json.dumps(settings))
    subprocess.run(["sync"], check=True)
    started = time.monotonic()
    result = subprocess.run([sys.executable, str(script), "--check-only"], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"sparkform-scrub found what it should not: {result.stdout}{result.stderr}")
    return time.monotonic() - started


def resume_refetched(hub: FakeHub, work: Path, shard: Path) -> tuple[int, bool]:
    """Bytes of `shard` the hub sent after its download was cut at 90 % (10 % of it at best, all
    of it when nothing resumes), and whether the fetch then verified (exit 0, the marker written)."""
    cut_at = shard.stat().st_size * 9 // 10
    hub.clear_requests()
    hub.cut(shard.name, cut_at)
    folder = work / "resumed"
    fetch_seconds(hub, work, folder, "--include", shard.name)
    sent = sum(r["sent"] for r in hub.requests if r["method"] == "GET" and r["path"].endswith(f"/{shard.name}"))
    return sent - cut_at, (folder / COMPLETE_MARKER).is_file()


def noop_check_seconds(work: Path, shards: int = 11, total_gib: int = 22) -> float:
    models = work / "models"
    folder = models / "org--scaled@main"
    folder.mkdir(parents=True)
    entries = []
    for index in range(shards):
        path = folder / f"model-{index:05d}-of-{shards:05d}.safetensors"
        with open(path, "wb") as out:
            out.truncate(total_gib * GIB // shards)  # sparse: the check never reads the bytes
        entries.append({"path": path.name, "size": path.stat().st_size, "sha256": "-", "mtime": path.stat().st_mtime})
    (folder / CHECKPOINT_MANIFEST).write_text(json.dumps({"files": entries}))
    # The Snapshot fact's own command; its python3 is this interpreter, not a wrapper PATH finds first (pyenv's).
    command = checkpoint_scan_command(str(models))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    started = time.monotonic()
    lines = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True, env=env).stdout
    elapsed = time.monotonic() - started
    assert lines.strip().endswith("|ok"), lines
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--shard-mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3, help="downloads of each kind; the median is printed")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sparkform-bench-"))
    try:
        source = make_repo(work / "source", args.shards, args.shard_mib)
        with FakeHub(work / "hub") as hub:
            hub.files(REPO, hub.add_repo(REPO, source))  # the hub hashes its files once, before any timing
            mib = args.shards * args.shard_mib
            shards = sorted(source.glob("*.safetensors"))
            subprocess.run(["sync"], check=True)
            # Whatever runs first pays for a cold machine (measured: half the rate of a later run):
            # each round runs the three in another order, and each figure is the median of its rounds.
            runs: dict[str, list[tuple[float, float]]] = {"script": [], "curl": [], "curl --parallel": []}
            measure = {
                "script": lambda: fetch_seconds(hub, work, work / "fetched"),
                "curl": lambda: curl_seconds(hub, shards, work, parallel=False),
                "curl --parallel": lambda: curl_seconds(hub, shards, work, parallel=True),
            }
            names = list(measure)
            for round_number in range(args.rounds):
                for name in names[round_number % 3 :] + names[: round_number % 3]:
                    runs[name].append(measure[name]())
                    if name == "script" and round_number < args.rounds - 1:
                        shutil.rmtree(work / "fetched")
            fetch, streaming = (statistics.median(times) for times in zip(*runs["script"], strict=True))
            curl, curl_disk = (statistics.median(times) for times in zip(*runs["curl"], strict=True))
            curl_parallel, curl_parallel_disk = (
                statistics.median(times) for times in zip(*runs["curl --parallel"], strict=True)
            )
            scrub_rate = HostConfig().scrub.rate_mib_s
            scrub_bounded = scrub_seconds(work, work / "fetched", scrub_rate)
            scrub_unbounded = scrub_seconds(work, work / "fetched", 10**6)
            shutil.rmtree(work / "fetched")
            refetched, verified = resume_refetched(hub, work, shards[0])
        print(
            f"first download, {mib} MiB in {args.shards} shards, median of {args.rounds} rounds in rotating order: "
            f"sparkform-checkpoint {mib / fetch:.0f} MiB/s "
            f"({fetch:.2f} s: sha256 of every byte, every file fsync'd before the marker; "
            f"{mib / streaming:.0f} MiB/s, {streaming:.2f} s, after its start-up)"
        )
        for name, fetched, on_disk in (
            ("curl", curl, curl_disk),
            ("curl --parallel", curl_parallel, curl_parallel_disk),
        ):
            print(
                f"  {name}: {mib / on_disk:.0f} MiB/s to disk ({on_disk:.2f} s with fsync; ratio "
                f"{on_disk / fetch:.2f}, after start-up {on_disk / streaming:.2f}), {mib / fetched:.0f} MiB/s to "
                f"the page cache ({fetched:.2f} s; ratio {fetched / fetch:.2f}, after start-up "
                f"{fetched / streaming:.2f})"
            )
        print(
            f"resume of a {args.shard_mib} MiB shard cut at 90 %: {refetched / 2**20:.1f} MiB fetched after the cut "
            f"({100 * refetched / (args.shard_mib * 2**20):.1f} % of the shard, target <= 15 %), "
            f"{'verified' if verified else 'NOT verified'}"
        )
        print(
            f"scrub of the {mib} MiB fetched (--check-only): {mib / scrub_bounded:.0f} MiB/s at its bound of "
            f"{scrub_rate} MiB/s (scrub.rate_mib_s; {scrub_bounded:.2f} s), {mib / scrub_unbounded:.0f} MiB/s "
            f"unbounded ({scrub_unbounded:.2f} s)"
        )
        for name, times in runs.items():  # the script's total; curl's to disk
            shown = [total if name == "script" else on_disk for total, on_disk in times]
            print(f"  rounds of {name}: " + ", ".join(f"{mib / seconds:.0f}" for seconds in shown) + " MiB/s")
        noop = noop_check_seconds(work)
        print(
            f"no-op check of 22 GiB in 11 shards (size + mtime against the manifest): {noop * 1000:.0f} ms, "
            f"{noop / 22 * 1000:.1f} ms per GiB (target: under 1 s in all)"
        )
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
