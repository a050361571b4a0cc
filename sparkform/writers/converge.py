"""The converge plan: every decision one run takes, from the inventory and the host's snapshot.

The deploy (sparkform/deploy/converge.py) gathers the snapshot that `snapshot_request` names, asks `plan` what to
do, and calls one operation per step, reading each decision from the plan. What restarts, what counts as a cold
start, which boot-chain hole the run repairs, which units are leftovers, which services it keeps (services.py), and
the order of it all live here, so they are tested on snapshots without pyinfra (tests/unit/test_converge_plan.py).
"""

from __future__ import annotations

import datetime
import hashlib
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from sparkform.domain import layout
from sparkform.domain.engine import Engine
from sparkform.domain.model import Problem
from sparkform.domain.rendered import RenderedFile, Secret
from sparkform.domain.schema import HostConfig
from sparkform.host.front_keys import clients_snippet
from sparkform.readers import hostrecord
from sparkform.readers.hostrecord import EngineRecord, HostRecord, HostVersions
from sparkform.readers.kept import KeptSettings, settings_digest
from sparkform.readers.parsers import EngineState
from sparkform.readers.snapshot import RemoteFile, Snapshot
from sparkform.rules import bootchain
from sparkform.rules.front_tls import FrontCertificate, front_certificate, tls_files, tls_paths
from sparkform.writers.programs import module_folders
from sparkform.writers.render import monitoring_packages, prerequisite_packages, render_host
from sparkform.writers.services import ServiceStep, service_digests, service_steps, service_units


def sha256(content: str) -> str:
    return hashlib.sha256(content.encode()).hexdigest()


def differs(content: str, current: RemoteFile | None) -> bool:
    """Whether the host's copy (None: absent) holds something else than `content`."""
    return current is None or current.sha256 != sha256(content)


def secrets(config: HostConfig) -> list[Secret]:
    """Secrets read from files on the control machine, root's on the host: the HF token (root's
    only), and the clients' API keys as the snippet the front includes (readable by the front's
    group too; validation checked their characters, so they need no escaping inside nginx's
    quotes). The engines never hold a key."""
    result = []
    if config.hf_token_file:
        token = Path(config.hf_token_file).expanduser().read_text().strip()
        result.append(Secret(config.paths.hf_token, f"{token}\n", "600", "root"))
    if config.front_keyed:
        clients = {name: Path(path).expanduser().read_text().strip() for name, path in config.client_key_files.items()}
        # nginx's master reads it at each start and reload, as the front's user (its group).
        result.append(Secret(config.paths.front_key, clients_snippet(clients), "640", layout.FRONT_USER))
    if config.alert_webhook_file:
        url = Path(config.alert_webhook_file).expanduser().read_text().strip()
        result.append(Secret(config.paths.alert_webhook, f"{url}\n", "600", "root"))
    return result


def unwanted(config: HostConfig) -> list[str]:
    """Files that must not be on the host: the engines' old copy of the API key (before the
    front), the guard's and the scrub's settings where they were before they moved beside them,
    Debian's default nginx site, the front's key and the alert webhook once the
    inventory names none, and sparkform's metrics once monitoring is off (node_exporter itself,
    and its settings, stay: the package is the owner's to remove)."""
    paths = [config.paths.retired_engine_env, *config.paths.retired_settings, layout.NGINX_DEFAULT_SITE]
    return (
        paths
        + ([] if config.front_keyed else [config.paths.front_key])
        + ([] if config.alert_webhook_file else [config.paths.alert_webhook])
        + ([] if config.monitoring.enabled else config.monitoring.textfiles)
    )


def engine_user_problems(host: str, config: HostConfig, snapshot: Snapshot) -> list[Problem]:
    """The engine user must be new or sparkform's own (its home the engine home, or the state
    folder where an earlier sparkform put it): an existing account of something else (`ubuntu`,
    `postgres`) would get its home moved and its files opened to the engines."""
    home = snapshot.users.get(config.engine_user)
    if home is None or home in (config.paths.engine_home, config.state_dir):
        return []
    return [
        Problem(
            host,
            "engine_user",
            config.engine_user,
            f"an account of this host that sparkform did not make (its home is {home})",
            "name an account that does not exist yet (the default vllm), and sparkform makes it",
        )
    ]


@dataclass(frozen=True)
class Folder:
    path: str
    mode: str
    user: str = "root"
    group: str = "root"


def folders(config: HostConfig) -> list[Folder]:
    """Every folder the deploy manages, parents first. Root reads back and runs only what lies
    in root's folders; the engine user owns exactly its home, the launch locks, each engine's
    cache and socket folder, none of which holds a folder of root's: it replaces nothing root trusts."""
    engine_user = config.engine_user
    result = [
        Folder(config.lib_dir, "755"),
        *(Folder(path, "755") for path in module_folders(config)),
        Folder(config.config_dir, "755"),
        Folder(config.paths.engines_dir, "755"),
        # Secrets are root's; the front's user (nginx, its master too) may pass into the folder to
        # its key (0640 root:www-data), and lists nothing.
        Folder(config.paths.secrets_dir, "710", group=layout.FRONT_USER),
        Folder(config.state_dir, "755"),
        Folder(config.paths.engine_home, "750", engine_user, engine_user),
        Folder(config.paths.lock_dir, "755", engine_user, engine_user),
        Folder(layout.record_dir(config.state_dir), "755"),
        # The settings kept for a rollback: root's alone, what root writes back into units.
        Folder(layout.kept_root(config.state_dir), "700"),
        Folder(config.paths.host_lock_dir, "700"),
        Folder(config.paths.cache_keys, "755"),
        Folder(config.venv_root, "755"),
        # Checkpoints belong to root: an engine can read its weights, never change them.
        Folder(config.models_dir, "755"),
        Folder(config.pins_dir, "755"),
        Folder(config.cache_root, "755"),
        Folder(posixpath.dirname(layout.FRONT_DROP_IN), "755"),
    ]
    if config.monitoring.enabled:
        # The textfiles' folder is root's alone: root writes into it, node_exporter only reads.
        result += [
            Folder(config.monitoring.textfile_dir, "755"),
            Folder(posixpath.dirname(layout.NODE_EXPORTER_DROP_IN), "755"),
        ]
    caches = [Folder(config.engine_cache_dir(engine), "750", engine_user, engine_user) for engine in config.engines]
    # Each engine's socket folder: its user's, setgid to the front's group (tmpfiles.d: again at boot).
    sockets = [layout.engine_socket_dir(config.socket_dir, engine.name) for engine in config.engines]
    return [*result, *caches, Folder(config.socket_dir, "755")] + [
        Folder(path, "2750", engine_user, layout.FRONT_USER) for path in sockets
    ]


def snapshot_request(config: HostConfig) -> dict:
    """What the snapshot fact reads for `config` (its keyword arguments)."""
    rendered = render_host(config)
    services = service_units(config)
    return dict(
        packages=prerequisite_packages(config.device) + monitoring_packages(config),
        users=[config.engine_user],
        paths=(
            [f.path for f in folders(config)]
            + [f.path for f in rendered]
            + [s.path for s in secrets(config)]
            + tls_paths(config)
            + unwanted(config)
            + ([config.monitoring.record_textfile] if config.monitoring.enabled else [])
        ),
        markers=[
            *(layout.venv_marker(pin.venv) for pin in config.pins),
            *(config.paths.stamp(service) for service in services),
        ],
        units=[*(engine.unit for engine in config.engines), layout.ENGINES_TARGET, *services.values()],
        unit_glob=layout.ENGINE_UNIT_GLOB,
        models_dir=config.models_dir,
        pins_dir=config.pins_dir,
        cache_root=config.cache_root,
        cache_keys_dir=config.paths.cache_keys,
        record_path=config.paths.host_record,
        kept_root=layout.kept_root(config.state_dir),
        venv_root=config.venv_root,
        front_certificate=config.paths.front_certificate if config.front_tls_on else None,
    )


def starts(current: EngineState | None, restart: bool) -> bool:
    """Whether the engine's unit (re)starts: asked to, never started, or not active."""
    return restart or current is None or current.active_state != "active"


def caches_aside(config: HostConfig, engine: Engine, snapshot: Snapshot) -> list[str]:
    """The engine's cache folders a previous run moved aside."""
    return [
        path
        for path in snapshot.caches_aside
        if path.startswith(f"{config.engine_cache_dir(engine)}{hostrecord.STALE_MARK}")
    ]


def planned_record(
    config: HostConfig, live: HostVersions, live_keys: Mapping[str, str], record: HostRecord | None, snapshot: Snapshot
) -> HostRecord:
    """The record as this run will leave it (`live_keys`: each engine's cache key), with the boot's starts that
    systemd measured; starts this run makes are measured on the host when it writes the record. A restart systemd
    made on its own later in the same boot is not a change to converge (a dry-run after a crash shows none): the
    record keeps the boot's start."""
    engines = {}
    for engine in config.enabled_engines:
        old = record.engines.get(engine.name) if record else None
        key = live_keys[engine.name]
        entry = EngineRecord(key) if old is None else replace(old, cache_key=key)
        state = snapshot.engines.get(engine.unit)
        recorded_this_boot = (
            entry.started_at is not None and snapshot.booted_at is not None and entry.started_at >= snapshot.booted_at
        )
        measured = state is not None and state.started_at and state.start_s
        if state is not None and measured and state.started_at != entry.started_at and not recorded_this_boot:
            entry = replace(entry, started_at=state.started_at, start_s=state.start_s, last_start_cold=False)
        engines[engine.name] = entry
    return HostRecord(live, engines)


@dataclass(frozen=True)
class BootChainHole:
    """An enabled unit ordered after an engine unit that is not enabled: the edge orders nothing."""

    unit: str
    waits_for: str
    state: str  # the unit file state of `waits_for`, or "missing"
    repaired: bool  # this run rewrites `unit`, starts `waits_for`, or keeps no engine of `unit`


@dataclass(frozen=True)
class LeftoverEngine:
    """An engine unit sparkform wrote for an engine that has left the inventory."""

    name: str
    unit_path: str
    settings: tuple[str, str]  # its environment and arguments files


@dataclass(frozen=True)
class EngineStep:
    """One enabled engine's turn, in start order."""

    engine: Engine
    current: EngineState | None
    stale: bool  # its JIT caches no longer match the host: moved aside, rebuilt at this start
    restart: bool  # its settings, caches or checkpoint's files changed: it restarts even if it runs
    starts: bool  # it (re)starts in this run
    cold: bool  # that start rebuilds its JIT caches (stale, or never keyed on this host)
    cold_start_s: float | None  # its last cold start: the host record's, else the inventory's (None: never measured)
    settings: str  # the digest of its unit, env and args files as this run renders them
    kept: KeptSettings | None  # the settings it last served with, kept on the host (None: none yet)

    @property
    def rolls_back(self) -> bool:
        """A failed start of this run puts it back on its kept settings: it starts on settings
        other than those it last served with."""
        return self.starts and self.kept is not None and self.kept.digest != self.settings


@dataclass(frozen=True)
class ConvergePlan:
    config: HostConfig
    rendered: list[RenderedFile]
    secrets: list[Secret]
    unwanted: list[str]
    drift_lines: list[str]  # what changed since the last converge, for the log and an alert
    holes: list[BootChainHole]
    leftovers: list[LeftoverEngine]
    daemon_reload: bool
    disabled: list[Engine]  # stopped (their units stay, disabled)
    steps: list[EngineStep]  # the enabled engines, each after every engine it waits for
    cache_keys: dict[str, str]  # what each engine's JIT caches are keyed under now (its vLLM's and the host's versions)
    front_wanted: str  # the digest nginx must run with (its drop-in, config, keys and certificate)
    certificate: FrontCertificate | None  # what the front serves over TLS (None: plain HTTP)
    guard_wanted: str  # the digest the guard must run with (its files)
    node_exporter_wanted: str  # the digest node_exporter must run with (its settings and drop-in)
    scrub_wanted: str  # the digest the scrub's timer must be armed with (its unit)
    services: list[ServiceStep]  # the front, the guard, the scrub's timer and node_exporter, kept after the engines
    rollback_lines: list[str]  # engines back on their kept settings that this run renders the failed ones of
    record: HostRecord  # the host record as this run leaves it

    @property
    def shared_files(self) -> list[RenderedFile]:
        """Scripts and units no single engine owns: put first (the checkpoint fetch is one)."""
        return [f for f in self.rendered if f.engine is None]

    @property
    def engine_files(self) -> list[RenderedFile]:
        """Each engine's unit and settings: put once its venv and checkpoint are complete."""
        return [f for f in self.rendered if f.engine is not None]

    @property
    def drift_alert(self) -> str | None:
        """What the guard alerts before any start, heard even if a start fails (None: no drift)."""
        return "; ".join(self.drift_lines) or None

    @property
    def stale_steps(self) -> list[EngineStep]:
        """The steps of engines whose caches go aside before any engine starts (no cold start beside another)."""
        return [step for step in self.steps if step.stale]

    @property
    def served_steps(self) -> list[EngineStep]:
        """The steps of engines whose API this host serves, in start order."""
        return [step for step in self.steps if not self.config.is_worker(step.engine)]

    @property
    def worker_steps(self) -> list[EngineStep]:
        """The steps of the ranks this host runs headless for a head elsewhere."""
        return [step for step in self.steps if self.config.is_worker(step.engine)]

    @property
    def started(self) -> dict[str, bool]:
        """Engine -> whether its start in this run rebuilds its caches (cold)."""
        return {step.engine.name: step.cold for step in self.steps if step.starts}

    @property
    def engines_target(self) -> bool:
        """Whether the run reaches the engines target: an engine runs on this host."""
        return bool(self.steps)


def checkpoint_complete(config: HostConfig, engine: Engine, snapshot: Snapshot) -> bool:
    """Whether the engine's checkpoint folder is complete at its pinned commit with every file as
    its manifest recorded (size and mtime); otherwise this run fetches (some of) it again."""
    current = snapshot.checkpoints.get(config.checkpoint_dir(engine))
    return current is not None and current.marker == config.commit(engine) and not current.drift


def engine_settings_digest(config: HostConfig, engine: Engine, rendered: list[RenderedFile]) -> str:
    """The settings_digest of the engine's unit, env and args files as rendered."""
    contents = {f.path: f.content for f in rendered}
    return settings_digest(*(contents[path] for path in config.paths.engine_files(engine.name)))


def kept_checkpoints(snapshot: Snapshot) -> set[str]:
    """Checkpoint folders some engine's kept settings (or those kept before them) load: cleanup
    keeps them, so a rollback always finds its weights."""
    return {kept.checkpoint for kept in [*snapshot.kept.values(), *snapshot.previous.values()]}


def rollback_lines(config: HostConfig, snapshot: Snapshot, rendered: list[RenderedFile]) -> list[str]:
    """One line per engine that went back to its kept settings from the very settings this run
    renders again: until the inventory changes, a re-run says it repeats a change that failed."""
    return [
        snapshot.rollbacks[engine.name].line()
        for engine in config.engines
        if engine.name in snapshot.rollbacks
        and snapshot.rollbacks[engine.name].failed == engine_settings_digest(config, engine, rendered)
    ]


def plan(
    config: HostConfig,
    snapshot: Snapshot,
    model_configs: Mapping[str, dict] | None = None,
    now: datetime.datetime | None = None,
) -> ConvergePlan:
    """Everything one converge of `config` (its pins resolved) does to the host in `snapshot`
    (`model_configs`: the checkpoints' config.json by engine, for the KV ledger's prediction;
    `now`: the time a self-signed certificate is judged and made at)."""
    certificate = front_certificate(config, snapshot, now or datetime.datetime.now(datetime.UTC))
    certificate_files, certificate_key = tls_files(config, certificate)
    rendered = render_host(config, model_configs) + certificate_files
    changed = {f.path for f in rendered if differs(f.content, snapshot.paths.get(f.path))}
    order = bootchain.start_order(config)
    live = hostrecord.parse_live_versions(snapshot.live_versions, config.pin().label)
    live_keys = hostrecord.engine_cache_keys(live, {e.name: config.pin(e).label for e in config.enabled_engines})
    drift = hostrecord.drift(
        snapshot.record,
        live,
        {e.name: snapshot.cache_keys.get(e.name) for e in order},
        {e.name for e in order if caches_aside(config, e, snapshot)},
        live_keys,
    )
    last_cold = hostrecord.last_cold_starts(snapshot.record, {e.name: e.measured.cold_start_s for e in order})

    changed_units = {Path(f.path).name for f in rendered if f.is_unit and f.path in changed}
    enabled_after = {
        unit: state.after for unit, state in snapshot.engines.items() if state.unit_file_state == "enabled"
    }
    holes = [
        BootChainHole(unit, dep, state, bootchain.hole_repaired(unit, dep, order, changed_units))
        for unit, dep, state in bootchain.holes(enabled_after, snapshot.unit_files)
    ]

    kept_units = {f.path for f in rendered if f.is_unit}
    leftovers = [
        LeftoverEngine(name, path, config.paths.engine_settings(name))
        for path in sorted(snapshot.rendered_units - kept_units)
        if (name := layout.engine_of_unit_path(path)) is not None
    ]

    steps = []
    for engine in order:
        current = snapshot.engines.get(engine.unit)
        stale = engine.name in drift.stale_engines
        # A running engine holds its weights in memory: files fetched again (a corrupt or changed
        # one) reach it only through a restart.
        refetched = not checkpoint_complete(config, engine, snapshot)
        restart = (
            stale
            or refetched
            or any(
                f.engine == engine.name and f.path in changed and not bootchain.ordering_only(f, snapshot.order_blind)
                for f in rendered
            )
        )
        steps.append(
            EngineStep(
                engine,
                current,
                stale,
                restart,
                starts(current, restart),
                cold=stale or engine.name not in snapshot.cache_keys,
                cold_start_s=last_cold[engine.name],
                settings=engine_settings_digest(config, engine, rendered),
                kept=snapshot.kept.get(engine.name),
            )
        )

    secret_files = secrets(config) + certificate_key
    contents = {f.path: f.content for f in rendered} | {s.path: s.content for s in secret_files}
    wanted = service_digests(config, contents, certificate)
    served_ports = [step.engine.port for step in steps if not config.is_worker(step.engine)]
    return ConvergePlan(
        config=config,
        rendered=rendered,
        secrets=secret_files,
        unwanted=unwanted(config),
        drift_lines=hostrecord.drift_report(drift, last_cold),
        holes=holes,
        leftovers=leftovers,
        daemon_reload=bool(leftovers) or any(f.is_unit and f.path in changed for f in rendered),
        disabled=[engine for engine in config.engines if not engine.enabled],
        steps=steps,
        cache_keys=live_keys,
        front_wanted=wanted["nginx"],
        certificate=certificate,
        guard_wanted=wanted["guard"],
        node_exporter_wanted=wanted["node-exporter"],
        scrub_wanted=wanted["scrub"],
        services=service_steps(config, snapshot, wanted, served_ports),
        rollback_lines=rollback_lines(config, snapshot, rendered),
        record=planned_record(config, live, live_keys, snapshot.record, snapshot),
    )
