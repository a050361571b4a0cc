"""The programs sparkform installs on a host, and the modules they share.

Each program (guard, scrub, rollback, record, checkpoint, vllm_serve) is a module of this package.
Its path on the host (LIB_DIR/sparkform-NAME, sparkform.domain.layout.HostPaths) holds the launcher
(sparkform.host.launcher), which runs it from this package, installed whole under LIB_DIR/python
(HostPaths.host_modules). A program reads what varies per host from the rendered settings file
beside its path (settings_path). They run in the host's system Python (root's: `python3 -I`) or
in the engines' vLLM venv, neither of which has sparkform: standard library only (the checkpoint
fetcher's huggingface_hub comes with the venv). The core imports the programs' constants from
here, so each is written once, and the shape of each settings file: the core builds it, its
program reads it (tests/unit/test_program_settings.py holds the two to these shapes).
"""

import os
import sys
from typing import NotRequired, TypedDict

# How root runs Python on a host: isolated (no environment variable, user site or script folder
# among the places it imports from that another user could shape).
ROOT_PYTHON = ("/usr/bin/python3", "-I")
# On tmpfs, apart from the state folder's disk: an outage the engine's stop hook could not record
# there (full, read-only) is kept here, so its "serves again" alert still comes.
OUTAGE_SPARE_DIR = "/run/sparkform-outages"
# `journalctl MESSAGE_ID=...` lists every alert of every sparkform program (sparkform.host.alerts).
ALERT_MESSAGE_ID = "7d3f5c2a9e8b4f61a0c4d2e6b8f1a3c5"
RETRY_UNIT_PREFIX = "sparkform-retry-"  # the guard's delayed start of ENGINE: sparkform-retry-ENGINE.timer
SETTINGS_SUFFIX = ".json"


def settings_path(program: str) -> str:
    """The settings file the deploy renders beside a program (its path with .json added)."""
    return os.path.abspath(program) + SETTINGS_SUFFIX


def program_path() -> str:
    """The path the running program was started by (its launcher): the script python was handed,
    beside which its settings lie and by which it runs itself again. sys.argv[0] is the module's
    own file (the launcher's run_module put it there), but sys.argv is as long as the script's
    arguments, so the script sits that far from the end of python's own command line."""
    return os.path.abspath(sys.orig_argv[len(sys.orig_argv) - len(sys.argv)])


# --- the settings files (sparkform.writers.programs renders each as JSON) ---------------------------


class EngineProbe(TypedDict):
    """How the guard asks an engine whether it serves (sparkform.domain.engine.PROBES)."""

    route: str
    body: dict[str, object]
    answer: str  # the answer's field that holds a non-empty list


class PoolSettings(TypedDict):
    """The settings a KV pool depends on, as the engine's args file passes them (the guard reads
    them back from that file: sparkform.host.kvlog.started_settings)."""

    checkpoint: str
    max_model_len: int
    gpu_memory_utilization: float | None
    kv_cache_memory_bytes: int | None
    kv_cache_dtype: str


class PoolPrediction(TypedDict):
    """What `sparkform plan` predicts for an engine's KV pool (a ledger row carries it)."""

    kv_gib: float | None
    tokens: int | None
    concurrency: float | None
    source: str


class EngineLedger(TypedDict):
    """An engine's entry for the KV pool ledger: its args file, its settings and the prediction."""

    args: str
    settings: PoolSettings
    predicted: PoolPrediction


class AwaitedRanks(TypedDict):
    """The ranks on other hosts that the start of a head here waits for on its master port."""

    address: str
    port: int
    count: int


class GuardEngine(TypedDict):
    name: str
    unit: str
    socket: str  # the unix socket of the engine's own API, behind the front
    python: str  # its venv's python, which its launch execs: gone, its next start fails
    names: list[str]  # the names it serves under (no program reads them yet)
    probe: EngineProbe
    priority: int
    need_gib: float  # the MemAvailable the launch script wants before it starts the engine
    ledger: EngineLedger
    head: list[str | int] | None  # a rank this host runs headless: its head's [address, master port]
    ranks: AwaitedRanks | None


class GuardedFront(TypedDict):
    """A port of the front where the guard checks that a keyed request reaches an engine."""

    engine: str
    address: str
    port: int


class GuardSettings(TypedDict):
    """sparkform-guard.json."""

    engines: list[GuardEngine]
    state_dir: str
    outage_spare_dir: str  # where an engine's stop hook keeps its outage while state_dir takes no write
    webhook_file: str | None
    alert_command: str | None
    textfile: str | None
    gpu_textfile: str | None
    gpu_python: str
    nvml_report: str
    front_textfile: str | None
    front_access_log: str
    kv_ledger: str
    lock_dir: str
    fronts: list[GuardedFront]
    front_key: str | None
    front_certificate: str | None
    front_unit: str
    engines_target: str
    kv_ledger_rows: int
    recover_cooldown_s: int
    recover_backoff_max_s: int
    watchdog_interval_s: int
    watchdog_deadline_s: int
    watchdog_failures: int
    start_stall_s: int
    restart_s: int
    memory_warn_gib: float
    memory_critical_gib: float
    memory_margin_gib: float
    memory_poll_s: float
    start_poll_s: float
    pressure_starved_pct: int
    rank_join_s: int
    vllm_cli: str
    memory_settle_s: float
    gpu_poll_s: int
    front_count_s: float
    # Never rendered: the unit tests run the guard outside systemd, with these of their own.
    journal_socket: NotRequired[str]
    meminfo: NotRequired[str]
    outbox_first_s: NotRequired[float]


class CheckpointEngine(TypedDict):
    name: str
    unit: str


class ServedCheckpoint(TypedDict):
    """A checkpoint folder the scrub re-hashes, how it is fetched again and who serves it."""

    folder: str
    repo: str
    commit: str | None  # None until a deploy resolved the revision
    fetch: list[str]
    engines: list[CheckpointEngine]


class ScrubSettings(TypedDict):
    """sparkform-scrub.json."""

    checkpoints: list[ServedCheckpoint]
    rate_mib_s: int
    host_lock_wait_s: int
    host_lock: str
    retry_s: int
    retry_max_s: int
    repairs: str
    hf_endpoint: str | None
    hf_token_file: str | None
    guard: str


class RollbackEngine(TypedDict):
    unit: str
    files: list[str]  # its unit, env and args files, in sparkform.host.kept.KEPT_FILES order


class RollbackSettings(TypedDict):
    """sparkform-rollback.json."""

    engines: dict[str, RollbackEngine]
    kept_root: str
    guard: str
    target: str
