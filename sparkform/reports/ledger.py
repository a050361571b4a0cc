"""The KV pool ledger: every pool an engine printed at a start that served, beside the planner's
prediction for the same settings (docs/incidents.md#kv-pool-ledger kept it by hand).

The host keeps it: after each start that served (the deploy's, systemd's restarts, the guard's
retries, a rollback's), `sparkform-guard served ENGINE` reads that start's journal, the settings
the engine started with (its args file) and the prediction the deploy rendered into the guard's settings
(`guard_ledger`, here), and appends one JSON line to `<state_dir>/record/kv-ledger.jsonl`. This
module is the control machine's side: the prediction rendered for the host, the rows read back
(every value checked before use), the table `sparkform ledger` prints, and the newest matching
row that `sparkform plan --from-host` / `--ledger` plans with when an engine has no `measured`
figures.
"""

from __future__ import annotations

import posixpath
import shlex
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sparkform.domain.engine import Engine, Measured
from sparkform.domain.layout import KV_LEDGER_ROWS
from sparkform.domain.model import Host
from sparkform.domain.modelconfig import GIB
from sparkform.domain.schema import HostConfig
from sparkform.domain.shapes import NAME_PATTERN
from sparkform.host.kvlog import CHECKPOINT, KV_DTYPE, LINE_CHARS, MAX_GIB, MAX_TOKENS
from sparkform.readers.remote import LINK
from sparkform.rules import planner

_TIME = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z$"
_VERSION = r"^[0-9]+\.[0-9]+[0-9A-Za-z.+-]{0,40}$"
_SOURCE = r"^[A-Za-z0-9 .,;:()_+/-]{1,200}$"


class _Checked(BaseModel):
    # strict: a number must be a JSON number, a string a JSON string; nothing else is taken.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class PrintedPool(_Checked):
    """What vLLM printed at the start."""

    device: str = Field(pattern=r"^[A-Z]{3}$")
    """The device word of the pool line (GPU, CPU, XPU)."""
    tokens: int = Field(gt=0, le=MAX_TOKENS)
    """`KV cache size: N tokens`."""
    window: int | None = Field(None, gt=0, le=MAX_TOKENS)
    """The per-request length of `Maximum concurrency for W tokens per request`."""
    concurrency: float | None = Field(None, ge=0, le=MAX_TOKENS)
    """Full-window requests the pool holds at once."""
    kv_gib: float | None = Field(None, gt=0, le=MAX_GIB)
    """`Available KV cache memory` (GPU; none on vLLM's CPU build, whose pool is kv_cache_memory_bytes)."""


class PredictedPool(_Checked):
    """What `sparkform plan` predicted for the same settings, rendered at deploy time."""

    kv_gib: float | None = Field(None, ge=0, le=MAX_GIB)
    tokens: int | None = Field(None, ge=0, le=MAX_TOKENS)
    concurrency: float | None = Field(None, ge=0, le=MAX_TOKENS)
    source: str = Field(pattern=_SOURCE)
    """Where the planner took the KV memory and the tokens per GiB from."""


class LedgerRow(_Checked):
    """One start that served, as sparkform-guard appends it to the host's ledger."""

    time: str = Field(pattern=_TIME)
    """When the start served (UTC)."""
    engine: str = Field(pattern=NAME_PATTERN)
    vllm: str | None = Field(None, pattern=_VERSION)
    """The version the API server printed at this start."""
    checkpoint: str = Field(pattern=f"^{CHECKPOINT.pattern}$")
    """The checkpoint folder it served (owner--name@commit)."""
    max_model_len: int = Field(gt=0, le=MAX_TOKENS)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=0.95)
    """None when kv_cache_memory_bytes pins the pool (the utilization is not passed then)."""
    kv_cache_memory_bytes: int | None = Field(None, gt=0, le=int(MAX_GIB * GIB))
    kv_cache_dtype: str = Field(pattern=f"^{KV_DTYPE.pattern}$")
    measured: PrintedPool
    predicted: PredictedPool | None = None
    """None when the engine started on settings other than the deploy's (a rollback's kept ones)."""

    @property
    def date(self) -> str:
        return self.time.replace("T", " ")[:16]


# --- what the deploy renders for the host (sparkform-guard.json) ---------------------------------------------


def engine_settings(config: HostConfig, engine: Engine) -> dict:
    """The settings a pool depends on, as the engine's args file passes them (sparkform-guard
    reads them back from that file and compares)."""
    return {
        "checkpoint": posixpath.basename(config.checkpoint_dir(engine)),
        "max_model_len": engine.max_model_len,
        "gpu_memory_utilization": None if engine.kv_cache_memory_bytes else engine.gpu_memory_utilization,
        "kv_cache_memory_bytes": engine.kv_cache_memory_bytes,
        "kv_cache_dtype": engine.kv_cache_dtype,
    }


def prediction(host: Host, engine: Engine) -> dict:
    """What `sparkform plan` predicts for the engine, with its measured pool tokens left out (so
    the tokens come from config.json where model_config_path is set, not from the figure it is
    compared with)."""
    unmeasured = engine.model_copy(update={"measured": engine.measured.model_copy(update={"kv_pool_tokens": None})})
    plan = planner.engine_plan(host, unmeasured)
    return {
        "kv_gib": None if plan.kv_gib is None else round(plan.kv_gib, 4),
        "tokens": plan.pool_tokens,
        "concurrency": None if plan.concurrency is None else round(plan.concurrency, 4),
        "source": f"KV from {plan.kv_source}; tokens/GiB from {plan.tokens_source}",
    }


def guard_ledger(host: Host, engine: Engine) -> dict:
    """An engine's entry in sparkform-guard.json for the ledger: its args file, settings and prediction."""
    return {
        "args": host.config.paths.engine_settings(engine.name)[1],
        "settings": engine_settings(host.config, engine),
        "predicted": prediction(host, engine),
    }


# --- reading it back ------------------------------------------------------------------------------


def read_command(config: HostConfig) -> str:
    """The shell that prints the host's ledger, at most its kept rows, each line cut to LINE_CHARS;
    a symbolic link is named after LINK, never followed."""
    path = shlex.quote(config.paths.kv_ledger)
    return (
        f"if [ -L {path} ]; then echo {LINK}{path}; "
        f"elif [ -f {path} ]; then tail -n {KV_LEDGER_ROWS} -- {path} | cut -c1-{LINE_CHARS + 1}; fi"
    )


def read_rows(lines: list[str], where: str, untrusted: list[str]) -> list[LedgerRow]:
    """The rows of the ledger's lines; a line of another shape is left out and named in `untrusted`."""
    rows = []
    for number, line in enumerate(lines[-KV_LEDGER_ROWS:], 1):
        if line.startswith(LINK):
            untrusted.append(f"{line[len(LINK) :]} is a symbolic link, not read")
            continue
        if not line.strip():
            continue
        try:
            if len(line) > LINE_CHARS:
                raise ValueError("longer than any row sparkform-guard writes")
            rows.append(LedgerRow.model_validate_json(line))
        except (ValidationError, ValueError) as err:
            reason = str(err).splitlines()[0] if not isinstance(err, ValidationError) else _first_error(err)
            untrusted.append(f"{where} line {number} left out: {reason}")
    return rows


def _first_error(err: ValidationError) -> str:
    first = err.errors()[0]
    field = ".".join(str(part) for part in first["loc"]) or "the line"
    return f"{field}: {first['msg']}"


# --- the table ----------------------------------------------------------------------------------------


def error_pct(predicted: float | None, measured: float | None) -> str:
    """(predicted - measured) / measured, in percent; '-' when either is unknown."""
    if predicted is None or not measured:
        return "-"
    return f"{(predicted - measured) / measured * 100:+.1f} %"


def _number(value: float | int | None, spec: str) -> str:
    """The value in `spec`, a trailing 'x' kept as a suffix; '-' when unknown."""
    suffix = "x" if spec.endswith("x") else ""
    return "-" if value is None else format(value, spec.removesuffix("x")) + suffix


def format_ledger(host: str, rows: list[LedgerRow], untrusted: list[str]) -> str:
    """Like the field notes' appendix table: each start, its pool as printed, the prediction beside
    it and the error in percent."""
    header = (
        "date (UTC)",
        "engine",
        "vLLM",
        "util",
        "kv dtype",
        "KV GiB",
        "predicted",
        "error",
        "KV pool tokens",
        "predicted",
        "error",
        "concurrency at window",
        "predicted",
        "error",
    )
    table = [header]
    for row in rows:
        printed, predicted = row.measured, row.predicted
        kv_gib = printed.kv_gib
        predicted_kv_gib, predicted_tokens, predicted_concurrency = (
            (predicted.kv_gib, predicted.tokens, predicted.concurrency) if predicted else (None, None, None)
        )
        table.append(
            (
                row.date,
                row.engine,
                row.vllm or "-",
                _number(row.gpu_memory_utilization, ".2f"),
                row.kv_cache_dtype,
                _number(kv_gib, ".2f"),
                _number(predicted_kv_gib, ".2f"),
                error_pct(predicted_kv_gib, kv_gib),
                f"{printed.tokens:,}",
                _number(predicted_tokens, ","),
                error_pct(predicted_tokens, printed.tokens),
                "-"
                if printed.concurrency is None
                else f"{printed.concurrency:.2f}x at {printed.window or row.max_model_len:,}",
                _number(predicted_concurrency, ".2fx"),
                error_pct(predicted_concurrency, printed.concurrency),
            )
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    lines = [f"host {host}: KV pool ledger, {len(rows)} start(s) that served (the last {KV_LEDGER_ROWS} are kept)"]
    lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in table]
    sources = sorted({row.predicted.source for row in rows if row.predicted})
    lines += [f"  predicted: {source}" for source in sources]
    if any(row.predicted is None for row in rows):
        lines.append("  no prediction: the engine started on settings other than the last deploy's (a rollback)")
    lines += [f"  left out (untrusted): {line}" for line in untrusted]
    return "\n".join(lines)


# --- planning with it -------------------------------------------------------------------------------


def matches(row: LedgerRow, config: HostConfig, engine: Engine) -> bool:
    """Whether the row's start ran the settings the engine's pool depends on, as the inventory has
    them now: its checkpoint repo (any commit), window, KV dtype, pinned KV bytes and the vLLM it runs.
    The utilization may differ: the planner re-derives the pool from the same non-KV size."""
    return (
        row.engine == engine.name
        and row.checkpoint.startswith(engine.checkpoint.folder_prefix)
        and row.max_model_len == engine.max_model_len
        and row.kv_cache_dtype == engine.kv_cache_dtype
        and row.kv_cache_memory_bytes == engine.kv_cache_memory_bytes
        and row.vllm == config.pin(engine).version
    )


def measured_from(row: LedgerRow) -> Measured | None:
    """The row as an engine's `measured` figures; None when its KV memory is unknown."""
    kv_gib = row.measured.kv_gib or (row.kv_cache_memory_bytes / GIB if row.kv_cache_memory_bytes else None)
    if kv_gib is None:
        return None
    return Measured(
        gpu_memory_utilization=row.gpu_memory_utilization,
        kv_cache_gib=kv_gib,
        kv_pool_tokens=row.measured.tokens,
        cold_start_s=None,
    )


def has_measured(engine: Engine) -> bool:
    return engine.measured.kv_cache_gib is not None or engine.measured.kv_pool_tokens is not None


@dataclass(frozen=True)
class Used:
    """An engine the plan took from the ledger, and the row it took."""

    engine: str
    row: LedgerRow

    def line(self, host: str) -> str:
        row = self.row
        util = "" if row.gpu_memory_utilization is None else f", util {row.gpu_memory_utilization:.2f}"
        return (
            f"{self.engine}: measured figures from the ledger of {host}: the start of {row.date} UTC "
            f"(vLLM {row.vllm}{util}, window {row.max_model_len:,}, {row.measured.tokens:,} tokens)"
        )


def with_ledger(host: Host, rows: list[LedgerRow]) -> tuple[Host, list[Used]]:
    """The host with each engine that has no `measured` pool figures given those of the newest row
    whose settings match (rows are in the order they were appended)."""
    engines, used = [], []
    for engine in host.config.engines:
        found = next(
            (
                (row, measured)
                for row in reversed(rows)
                if matches(row, host.config, engine) and (measured := measured_from(row)) is not None
            ),
            None,
        )
        if has_measured(engine) or found is None:
            engines.append(engine)
            continue
        row, measured = found
        measured = measured.model_copy(update={"cold_start_s": engine.measured.cold_start_s})
        engines.append(engine.model_copy(update={"measured": measured}))
        used.append(Used(engine.name, row))
    config = host.config.model_copy(update={"engines": engines})
    return Host(host.name, config, host.model_configs), used
