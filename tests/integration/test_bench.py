"""`sparkform bench` on the sandbox pair: each engine alone, then both at
once, within the bounds it prints; a dated row in the host's ledger per bench; the PNG.

Short settings (32-token prompts, 16 generated, 2 requests per engine and phase): the engines
are tiny CPU models on 2 cores. What the bench says is checked against what the engines
themselves counted (their /metrics), not against its own output alone.
"""

from __future__ import annotations

import json
import re
import struct
import subprocess
import time

import pytest
from deploy_helpers import BIN, PATHS, SANDBOX_INVENTORY, engine_url, ssh

from sparkform.readers.parsers import parse_prometheus

pytestmark = pytest.mark.usefixtures("converged")
SHARES_SANDBOX = True  # it sends requests and appends to the bench ledger; the pair stays as converged
CI_MINUTES = 4  # wall time in CI, its sandbox setups included (the table at the end of `make test`)

ENGINES = ("nemotron", "q38")
REQUESTS, OUTPUT_LEN = 2, 16
SETTINGS = ["--input-len", "32", "--output-len", str(OUTPUT_LEN), "--requests", str(REQUESTS), "--timeout", "120"]
COMBINED = re.compile(r"^combined: ([\d.]+) tok/s with all generating, against ([\d.]+) tok/s for (\w+) alone", re.M)
ROW = re.compile(r"^(\S+)\s+([\d.]+) tok/s\s+([\d.]+) tok/s\s+([\d.]+)\s+([+-]\d+)%\s+(\d+) ms\s+(\d+) ms$", re.M)


def bench(*options: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    result = subprocess.run(
        [str(BIN / "sparkform"), "bench", str(SANDBOX_INVENTORY), *SETTINGS, *options],
        capture_output=True,
        text=True,
        timeout=900,
    )
    return result, time.monotonic() - started


def ledger(box) -> list[str]:
    return ssh(box, f"cat {PATHS.bench_ledger} 2>/dev/null || true").stdout.splitlines()


def pinned_requests(box) -> dict[str, float]:
    """Per engine, the requests it finished with 11 to 20 generated tokens (the bench's 16; the
    guard's probes generate 1), from its own /metrics histogram."""
    counts = {}
    for engine in ENGINES:
        text = ssh(box, f"curl -sS -m 5 {engine_url(engine, '/metrics')}").stdout
        buckets = {
            s.labels["le"]: s.value
            for s in parse_prometheus(text.splitlines())
            if s.name == "vllm:request_generation_tokens_bucket"
        }
        counts[engine] = buckets["20.0"] - buckets["10.0"]
    return counts


def test_bench_measures_each_engine_alone_then_both_and_adds_a_dated_row(box, tmp_path):
    rows_before, requests_before = ledger(box), pinned_requests(box)
    png = tmp_path / "bench.png"
    result, seconds = bench("--plot", str(png))
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    bound = int(re.search(r"the whole bench within (\d+) s", out)[1])
    assert seconds < bound, (seconds, out)
    figures = {m[1]: m.groups()[1:] for m in ROW.finditer(out)}
    assert set(figures) == set(ENGINES), out
    for engine, (alone, together, ratio, delta, ttft_alone, ttft_together) in figures.items():
        assert float(alone) > 0 and float(together) > 0 and int(ttft_alone) >= 0 and int(ttft_together) >= 0
        assert float(ratio) == pytest.approx(float(together) / float(alone), abs=0.01), engine
        assert int(delta) == pytest.approx((float(together) / float(alone) - 1) * 100, abs=1), engine
    combined = COMBINED.search(out)
    assert float(combined[1]) == pytest.approx(sum(float(f[1]) for f in figures.values()), abs=0.15), out
    assert combined[2] == max((f[0] for f in figures.values()), key=float) and figures[combined[3]][0] == combined[2]
    # Each engine served the requests of its two phases, every one 16 tokens long (ignore_eos),
    # and one more per phase: the generator's untimed ready check.
    served = pinned_requests(box)
    assert {e: served[e] - requests_before[e] for e in ENGINES} == {e: 2 * (REQUESTS + 1) for e in ENGINES}
    rows = ledger(box)
    assert rows[: len(rows_before)] == rows_before and len(rows) == len(rows_before) + 1
    row = json.loads(rows[-1])
    today = ssh(box, "date -u +%Y-%m-%d").stdout.strip()
    assert row["date"].startswith(today) and set(row["engines"]) == set(ENGINES)
    assert row["engines"]["q38"]["alone_tok_s"] == pytest.approx(float(figures["q38"][0]), abs=0.05)
    assert ssh(box, f"stat -c '%U %a' {PATHS.bench_ledger}").stdout.split() == ["root", "644"]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", data[16:24]) == (1100, 450)

    result, seconds = bench()
    assert result.returncode == 0 and seconds < bound, result.stdout + result.stderr
    assert len(ledger(box)) == len(rows_before) + 2
    assert f": bench ledger, {len(rows_before) + 2} benches\n" in result.stdout
