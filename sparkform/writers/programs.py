"""The programs sparkform puts on a host (sparkform.host, byte for byte: the launcher at each
program's path, the package itself under HostPaths.host_modules) and the settings files rendered
beside them: what each knows about the host, as JSON.

Pure: files and dicts from a validated host; nothing here opens a connection.
"""

from __future__ import annotations

import getpass
import json
import os
import shlex
from collections.abc import Mapping
from importlib import resources
from typing import cast

from sparkform.domain.engine import Engine
from sparkform.domain.layout import (
    ENGINES_TARGET,
    FRONT_ACCESS_LOG,
    FRONT_UNIT,
    GUARD_UNIT,
    KV_LEDGER_ROWS,
    RECOVER_UNIT,
    kept_root,
    record_dir,
    unit_path,
)
from sparkform.domain.model import Host
from sparkform.domain.modelconfig import GIB
from sparkform.domain.rendered import RenderedFile
from sparkform.domain.schema import HostConfig
from sparkform.host import (
    OUTAGE_SPARE_DIR,
    ROOT_PYTHON,
    AwaitedRanks,
    CheckpointEngine,
    EngineLedger,
    EngineProbe,
    GuardedFront,
    GuardEngine,
    GuardSettings,
    RollbackEngine,
    RollbackSettings,
    ScrubSettings,
    ServedCheckpoint,
)
from sparkform.reports import ledger

# How long a rank this host runs for a head elsewhere may take from its start to its connection to
# the head's master port (importing vLLM; tens of seconds on the sandbox's two cores) before the
# guard judges that connection.
RANK_JOIN_S = 120
# The modules of sparkform.host that are programs: each one's path (LIB_DIR/sparkform-NAME, the
# HostPaths property of the same role) holds the launcher, which runs the module of that name.
PROGRAMS = ("checkpoint", "guard", "record", "rollback", "scrub", "vllm_serve")


def host_source(module: str, suffix: str = ".py") -> str:
    """A module of sparkform.host as it lands on the host: its text, byte for byte."""
    return resources.files("sparkform.host").joinpath(f"{module}{suffix}").read_text(encoding="utf-8")


def run_by(command: str) -> str:
    """A run as the host lock's holder line names it: what, who, from where."""
    return f"{command} by {getpass.getuser()}@{os.uname().nodename} (pid {os.getpid()})"


def host_lock_words(config: HostConfig, mode: str, what: str) -> list[str]:
    """sparkform.host.hostlock run on the host by its own source (the host may not have
    sparkform yet): `hold` or `run`, its wait, the lock, and `what` (made printable there)."""
    return [
        *ROOT_PYTHON,
        "-c",
        host_source("hostlock"),
        mode,
        str(config.host_lock_wait_s),
        config.paths.host_lock,
        what,
    ]


def host_lock_command(config: HostConfig, what: str, sudo: bool) -> str:
    """The line a deploy runs on the host to hold the host lock for the rest of the run."""
    return ("sudo -n " if sudo else "") + shlex.join(host_lock_words(config, "hold", what))


def host_locked(config: HostConfig, what: str, command: str) -> str:
    """A shell line run on the host with the host lock held for `command`, stdin passed on."""
    return f"{shlex.join(host_lock_words(config, 'run', what))} -- {command}"


def shared_modules(config: HostConfig) -> list[RenderedFile]:
    """The package sparkform.host whole (the programs and the modules they share), under
    HostPaths.host_modules as the package lays it out: the launcher puts that folder first on the
    programs' import path."""
    base = f"{config.paths.host_modules}/sparkform"
    names = sorted(
        entry.name[: -len(".py")] for entry in resources.files("sparkform.host").iterdir() if entry.name.endswith(".py")
    )
    package = resources.files("sparkform").joinpath("__init__.py").read_text(encoding="utf-8")
    return [
        RenderedFile(f"{base}/__init__.py", package, "644"),
        *(RenderedFile(f"{base}/host/{name}.py", host_source(name), "644") for name in names),
    ]


def module_folders(config: HostConfig) -> list[str]:
    """The folders shared_modules lands in, parents first."""
    base = config.paths.host_modules
    return [base, f"{base}/sparkform", f"{base}/sparkform/host"]


def min_available_kib(config: HostConfig, engine: Engine) -> int:
    """MemAvailable the launch script wants before it starts this engine."""
    share: float
    if engine.kv_cache_memory_bytes:
        share = engine.kv_cache_memory_bytes
    else:
        share = engine.gpu_memory_utilization * config.memory_total_gib * GIB
    return int((share + config.memory_available_margin_gib * GIB) // 1024)


def guard_files(config: HostConfig) -> list[str]:
    """The guard's program, settings and shared modules, its unit and the engines' OnFailure=
    unit: a change to any of them restarts the guard."""
    return [
        config.paths.guard,
        config.paths.guard_config,
        *(f.path for f in shared_modules(config)),
        unit_path(GUARD_UNIT),
        unit_path(RECOVER_UNIT),
    ]


def guard_settings(config: HostConfig, model_configs: Mapping[str, dict] | None = None) -> GuardSettings:
    """What sparkform-guard knows about the host (no secret: the webhook URL stays in its file).
    `model_configs` (engine -> config.json, the inventory's model_config_path) feed the planner's
    prediction that each start's KV ledger row carries."""
    host = Host("", config, dict(model_configs or {}))
    return GuardSettings(
        engines=[
            GuardEngine(
                name=e.name,
                unit=e.unit,
                socket=config.engine_socket(e),
                python=f"{config.pin(e).venv}/bin/python",
                names=e.names,
                probe=cast(EngineProbe, e.probe),
                priority=e.priority,
                need_gib=round(min_available_kib(config, e) / 2**20, 2),
                ledger=cast(EngineLedger, ledger.guard_ledger(host, e)),
                # A rank this host runs headless: where its head's master port is (no API to probe here).
                head=[config.span(e).master_address, e.master_port] if config.is_worker(e) else None,
                # The head of one: the ranks of other hosts its start waits for on its master port.
                ranks=(
                    AwaitedRanks(address=config.span(e).master_address, port=e.master_port, count=len(e.nodes) - 1)
                    if e.nodes and not config.is_worker(e)
                    else None
                ),
            )
            for e in config.enabled_engines
        ],
        state_dir=record_dir(config.state_dir),
        outage_spare_dir=OUTAGE_SPARE_DIR,
        webhook_file=config.paths.alert_webhook if config.alert_webhook_file else None,
        alert_command=config.alert_command,
        textfile=config.monitoring.guard_textfile if config.monitoring.enabled else None,
        gpu_textfile=config.monitoring.gpu_textfile if config.monitoring.enabled else None,
        # The GPU read as `sparkform status` reads it: NVML's report, by the venv's python (pynvml).
        gpu_python=f"{config.venv}/bin/python",
        nvml_report=f"{config.paths.host_modules}/sparkform/host/nvml_report.py",
        # Requests per client: counted from the front's access log into a textfile of its own.
        front_textfile=config.monitoring.front_textfile if config.monitoring.enabled else None,
        front_access_log=FRONT_ACCESS_LOG,
        kv_ledger=config.paths.kv_ledger,
        lock_dir=config.paths.lock_dir,
        # Where the guard checks that the front passes a keyed request (root's key file).
        fronts=[
            GuardedFront(engine=e.name, address=config.front_local_address, port=e.port) for e in config.served_engines
        ],
        front_key=config.paths.front_key if config.front_keyed else None,
        # Over TLS the guard trusts only the certificate the deploy wrote, whatever name it holds.
        front_certificate=config.paths.front_certificate if config.front_tls_on else None,
        front_unit=FRONT_UNIT,
        # Started again by the guard once every engine serves (sparkform/host/target.py).
        engines_target=ENGINES_TARGET,
        kv_ledger_rows=KV_LEDGER_ROWS,
        recover_cooldown_s=config.recover_cooldown_s,
        recover_backoff_max_s=config.recover_backoff_max_s,
        watchdog_interval_s=config.watchdog_interval_s,
        watchdog_deadline_s=config.watchdog_deadline_s,
        watchdog_failures=config.watchdog_failures,
        start_stall_s=config.start_stall_s,
        restart_s=config.restart_s,
        memory_warn_gib=config.memory_warn_gib,
        memory_critical_gib=config.memory_critical_gib,
        memory_margin_gib=config.memory_margin_gib,
        memory_poll_s=2,
        start_poll_s=5,
        pressure_starved_pct=40,
        rank_join_s=RANK_JOIN_S,
        vllm_cli=config.paths.vllm_cli,
        memory_settle_s=10,
        gpu_poll_s=15,
        front_count_s=15,
    )


def checkpoint_fetch(config: HostConfig, engine: Engine) -> list[str]:
    """The fetch of an engine's checkpoint, as the deploy and the scrub run it (argv; HF_TOKEN and
    HF_ENDPOINT go in its environment, never here)."""
    includes = [word for pattern in engine.checkpoint.include for word in ("--include", pattern)]
    return [
        f"{config.venv}/bin/python",
        "-I",  # root runs it: no PYTHON* variables, no user site, no script folder on sys.path
        config.paths.checkpoint,
        engine.checkpoint.repo,
        config.commit(engine) or engine.checkpoint.revision,
        config.checkpoint_dir(engine),
        *includes,
        "--workers",
        str(config.checkpoint_workers),
    ]


def scrub_settings(config: HostConfig) -> ScrubSettings:
    """What sparkform-scrub knows: each checkpoint an enabled engine serves, with its fetch and the
    engines to restart after a repair; the token's path, never the token."""
    folders: dict[str, ServedCheckpoint] = {}
    for engine in config.enabled_engines:
        checkpoint = folders.setdefault(
            config.checkpoint_dir(engine),
            ServedCheckpoint(
                folder=config.checkpoint_dir(engine),
                repo=engine.checkpoint.repo,
                commit=config.commit(engine),
                fetch=checkpoint_fetch(config, engine),
                engines=[],
            ),
        )
        checkpoint["engines"].append(CheckpointEngine(name=engine.name, unit=engine.unit))
    return ScrubSettings(
        checkpoints=list(folders.values()),
        rate_mib_s=config.scrub.rate_mib_s,
        host_lock_wait_s=config.host_lock_wait_s,
        host_lock=config.paths.host_lock,
        # A repair that failed: tried again after retry_s, doubled each time, up to retry_max_s.
        retry_s=config.scrub.retry_s,
        retry_max_s=config.scrub.retry_max_s,
        repairs=f"{record_dir(config.state_dir)}/scrub-repairs.json",
        hf_endpoint=config.hf_endpoint,
        hf_token_file=config.paths.hf_token if config.hf_token_file else None,
        guard=config.paths.guard,
    )


def rollback_settings(config: HostConfig) -> RollbackSettings:
    """What sparkform-rollback knows: the files of each engine it can put back, where they are
    kept, the guard it alerts through and the engines target it starts again."""
    return RollbackSettings(
        engines={
            engine.name: RollbackEngine(unit=engine.unit, files=list(config.paths.engine_files(engine.name)))
            for engine in config.engines
        },
        kept_root=kept_root(config.state_dir),
        guard=config.paths.guard,
        target=ENGINES_TARGET,
    )


def settings_file(path: str, settings: GuardSettings | ScrubSettings | RollbackSettings) -> RenderedFile:
    return RenderedFile(path, json.dumps(settings, indent=2, sort_keys=True) + "\n", "644")


def code_files(config: HostConfig) -> list[RenderedFile]:
    """The programs' paths, each holding the launcher, and the package they run from: sparkform.host's
    own text, byte for byte. None is an engine's file, so a change here restarts no engine."""
    paths = config.paths
    programs = [
        # Run by the venv's python (it needs huggingface_hub).
        paths.checkpoint,
        # Run by the system's python3: at the end of a converge, after a changed engine's failed
        # start (or by hand), as the guard's daemon and units, from the scrub's timer.
        paths.record,
        paths.rollback,
        paths.guard,
        paths.scrub,
    ]
    if any(engine.nodes for engine in config.engines):
        # Run by the venv's python for the ranks of an engine across hosts.
        programs.append(paths.vllm_cli)
    return [
        *(RenderedFile(path, host_source("launcher"), "644") for path in programs),
        # Read by nginx's njs module for the combined port (the front's config imports it).
        RenderedFile(paths.front_router, host_source("front_router", ".js"), "644"),
        *shared_modules(config),
    ]


def program_files(config: HostConfig, model_configs: Mapping[str, dict] | None = None) -> list[RenderedFile]:
    """Every program, the modules they share and the settings beside them (`model_configs`: the
    checkpoints' config.json by engine, for the KV ledger's prediction in the guard's settings)."""
    paths = config.paths
    return [
        *code_files(config),
        settings_file(paths.rollback_config, rollback_settings(config)),
        settings_file(paths.guard_config, guard_settings(config, model_configs)),
        settings_file(paths.scrub_config, scrub_settings(config)),
    ]
