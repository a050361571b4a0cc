"""The deploy, in pyinfra's packaged form: `converge_host` converges the current host (a Spark or
the sandbox) from its inventory data: packages, user, folders, the pinned vLLM venv,
checkpoints, rendered files and units, then the engines, one at a time in `after` order.

deploy.py calls it; a deploy file of one's own can too (`from sparkform.deploy.converge import
converge_host`, with this checkout's folder on sys.path), and pyinfra runs it by import path
from the checkout: `pyinfra inventory/spark.py sparkform.deploy.converge.converge_host`. Every operation's
name carries the deploy's ("sparkform | ...").

The host's data is validated again here (after --data overrides) before any operation is added,
so a bad value stops the run before anything on the host changes; one fact (HostSnapshot) reads
the host in one round trip; `sparkform.writers.converge.plan` decides everything from it. The
deploy only reads those decisions: five parts in order, each step one operation, and the services
beside the engines one table of the same step (SERVICE_OPERATIONS).
"""

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pyinfra import host, inventory, logger
from pyinfra.api import deploy

from sparkform.commands.hub import resolve_pins
from sparkform.deploy.facts.node_link import NodeLink
from sparkform.deploy.facts.snapshot import HostSnapshot
from sparkform.deploy.operations import (
    checkpoints,
    engines,
    files,
    front,
    guard,
    host_record,
    hostlock,
    jit,
    monitoring,
    scrub,
    system,
    venv,
)
from sparkform.domain import layout
from sparkform.domain.model import InventoryError
from sparkform.domain.rendered import RenderedFile
from sparkform.domain.schema import HostConfig
from sparkform.readers.kept import KeptSettings
from sparkform.readers.snapshot import Snapshot
from sparkform.rules import nodes
from sparkform.rules.inventory import exit_invalid, exit_untrusted, host_from_data
from sparkform.rules.nodes import span_problems
from sparkform.writers import converge
from sparkform.writers.render import prerequisite_packages


def planned() -> tuple[HostConfig, Snapshot, converge.ConvergePlan]:
    """This host's validated settings (spans and pins resolved), what it holds, and the plan;
    a bad inventory or an untrusted host stops the run here, before any change."""
    try:
        inventory_host = host_from_data(host.name, host.data.dict())
    except InventoryError as err:
        exit_invalid(err, f"data of host {host.name}")
    config = inventory_host.config
    # One run at a time: held from here, before the host is read, to the run's end.
    hostlock.host_locked(config)
    # An engine across hosts: the rules across its nodes on the data pyinfra merged (group data
    # included), then where its ranks meet, read off this node's link before any change.
    if spanning := [engine for engine in config.enabled_engines if engine.nodes]:
        peers = {
            name: host_from_data(name, inventory.get_host(name).data.dict())
            for name in {node for engine in spanning for node in engine.nodes}
            if inventory.get_host(name) is not None
        }
        if problems := span_problems(list(peers.values()), [peer.name for peer in inventory]):
            exit_invalid(InventoryError(problems), f"across the nodes of {host.name}")
        peer_configs = {name: peer.config for name, peer in peers.items()}
        # On a worker, the preflight also tries the head's master port (of the first engine it serves a rank of);
        # the NCCL it reads is that engine's venv's (an engine may run a vLLM of its own).
        ranked = next((engine for engine in spanning if config.is_worker(engine)), None)
        link = host.get_fact(
            NodeLink,
            interface=config.node_interface,
            venv=config.pin(ranked or spanning[0]).venv,
            head=(nodes.head_address(ranked, peer_configs), ranked.master_port) if ranked else None,
        )
        for line in nodes.preflight_lines(host.name, config, link):
            logger.info(line)
        spans, problems = nodes.spans(host.name, config, peer_configs, link)
        if problems:
            exit_invalid(InventoryError(problems), f"of host {host.name} (preflight)")
        config = config.spanned(spans)

    request = converge.snapshot_request(config)
    snapshot = host.get_fact(HostSnapshot, **request)
    # Root acts on nothing it did not write: a pin, key, marker or record of another shape stops
    # the run here, before any change (and before the hub is asked about a pin).
    if snapshot.untrusted:
        exit_untrusted(host.name, snapshot.untrusted)
    if problems := converge.engine_user_problems(host.name, config, snapshot):
        exit_invalid(InventoryError(problems), f"of host {host.name}")
    # Branches and tags become commits: the host's record of them, else the hub's answer now.
    try:
        config = config.pinned(resolve_pins(host.name, config, snapshot.pins))
    except InventoryError as err:
        exit_invalid(err, f"data of host {host.name}")
    plan = converge.plan(config, snapshot, inventory_host.model_configs)
    if plan.certificate:
        logger.info(
            f"[{host.name}] the front speaks HTTPS with {plan.certificate.origin}, SHA-256 fingerprint "
            f"{plan.certificate.fingerprint}; clients trust it (`sparkform cert INVENTORY --host {host.name}` "
            "prints it; docs/clients.md, TLS)"
        )
    # A link at a managed path would send root's writes, chmods and chowns wherever it points.
    if links := snapshot.planted_links(plan.unwanted):
        exit_untrusted(host.name, links)

    for line in plan.drift_lines:
        logger.warning(f"[{host.name}] since the last converge: {line}")
    # A change that failed and went back: a re-run tries it again, so it says so first.
    for line in plan.rollback_lines:
        logger.warning(f"[{host.name}] {line}")
    # The boot chain: an edge to a unit that is not enabled orders nothing (docs/incidents.md#boot-chain-hole).
    for hole in plan.holes:
        logger.warning(
            f"[{host.name}] boot chain: {hole.unit} waits for {hole.waits_for}, which is {hole.state}: "
            + ("this run repairs it" if hole.repaired else "fix that unit by hand")
        )
    return config, snapshot, plan


# The operation that keeps each service of the plan (ServiceStep.service): each hears its unit's
# state, its stamp on the host and the stamp this run's files make, and the options only it takes.
SERVICE_OPERATIONS: dict[str, Callable[..., Any]] = {
    "nginx": front.front_serving,
    "guard": guard.guard_running,
    "scrub": scrub.scrub_timer,
    "node-exporter": monitoring.node_exporter_serving,
}


@deploy("sparkform")
def converge_host() -> None:
    """Converge the current host (pyinfra's packaged deploy: deploy.py is a call of it), one part
    after the other, each reading what to do from the plan."""
    config, snapshot, plan = planned()
    _prerequisites(config, snapshot, plan)
    _engines_installed(config, snapshot, plan)
    _engines_started(config, snapshot, plan)
    _services_running(config, snapshot, plan)
    _finished(config, snapshot, plan)


def _prerequisites(config: HostConfig, snapshot: Snapshot, plan: converge.ConvergePlan) -> None:
    """Packages, the engine user, folders and secrets, and no file the host must not hold."""
    # node_exporter is not among them: it is installed after its settings are written (_services_running).
    system.packages_present(
        name="Install prerequisites", packages=prerequisite_packages(config.device), snapshot=snapshot
    )
    system.system_user(
        name=f"Engine user {config.engine_user}",
        user=config.engine_user,
        home=config.paths.engine_home,
        snapshot=snapshot,
    )
    for spec in converge.folders(config):
        system.folder(name=f"Folder {spec.path}", spec=spec, snapshot=snapshot)
    for secret in plan.secrets:
        files.managed_file(
            name=f"Secret {secret.path}",
            path=secret.path,
            content=secret.content,
            mode=secret.mode,
            group=secret.group,
            current=snapshot.paths.get(secret.path),
            secret=True,
        )
    for path in plan.unwanted:
        files.removed(name=f"No {path}", path=path, current=snapshot.paths.get(path))


def _files_put(selected: list[RenderedFile], snapshot: Snapshot) -> None:
    """Each rendered file, put where the host's copy differs."""
    for file in selected:
        files.managed_file(
            name=f"File {file.path}",
            path=file.path,
            content=file.content,
            mode=file.mode,
            current=snapshot.paths.get(file.path),
        )


def _engines_installed(config: HostConfig, snapshot: Snapshot, plan: converge.ConvergePlan) -> None:
    """Shared scripts first (the checkpoint fetch is one of them). Each engine's unit and settings
    only once its venv and checkpoint are complete: a failed fetch leaves the engine pointed at the
    revision it serves, and the next run still sees its settings as changed."""
    _files_put(plan.shared_files, snapshot)
    # A human hears of the drift even if a start below fails.
    if plan.drift_alert:
        guard.alerted(
            name="Alert: drift since the last converge",
            guard_script=config.paths.guard,
            event="drift",
            message=plan.drift_alert,
        )
    venv.wheelhouse_synced(name="Wheelhouse on the host", config=config, snapshot=snapshot)
    for pin in config.pins:
        venv.vllm_venv(
            name=f"vLLM venv {pin.requirement} ({Path(pin.venv).name})", config=config, pin=pin, snapshot=snapshot
        )
    for engine in config.enabled_engines:
        checkpoints.checkpoint(
            name=f"Checkpoint of {engine.name}: {engine.checkpoint.repo} "
            f"{engine.checkpoint.revision} -> {config.commit(engine)}",
            config=config,
            engine=engine,
            snapshot=snapshot,
        )
    _files_put(plan.engine_files, snapshot)


def _engines_started(config: HostConfig, snapshot: Snapshot, plan: converge.ConvergePlan) -> None:
    """Leftover engines removed and disabled ones stopped, then the enabled ones started in `after`
    order, each to readiness before the next."""
    for leftover in plan.leftovers:
        engines.engine_removed(
            name=f"Remove engine {leftover.name} (no longer in the inventory)",
            unit_path=leftover.unit_path,
            settings=list(leftover.settings),
        )
    engines.daemon_reload(name="Reload systemd units", needed=plan.daemon_reload)
    for engine in plan.disabled:
        engines.engine_stopped(
            name=f"Stop disabled engine {engine.name}", engine=engine, current=snapshot.engines.get(engine.unit)
        )
    # Stale caches aside before any engine starts: no cold start beside another one.
    for step in plan.stale_steps:
        jit.cache_moved_aside(
            name=f"JIT caches of {step.engine.name} aside (stale)", config=config, engine=step.engine, snapshot=snapshot
        )
    # The ranks this host runs for heads elsewhere, before any head starts (pyinfra runs each
    # operation on every host before the next): a head's start returns only once its ranks joined.
    for step in plan.worker_steps:
        engines.rank_running(
            name=f"Engine {step.engine.name}: rank {config.rank(step.engine)} running",
            engine=step.engine,
            current=step.current,
            restart=step.restart,
        )
    # One at a time, in `after` order: each `systemctl start` returns when its engine serves. A
    # changed engine whose start fails goes back to the settings it last served with, and the run
    # stops there; once it serves, what it serves is kept for the next time.
    for step in plan.served_steps:
        engines.engine_running(
            name=f"Engine {step.engine.name} serving",
            engine=step.engine,
            current=step.current,
            restart=step.restart,
            cold=step.cold,
            cold_start_s=step.cold_start_s,
            budget_s=config.readiness_budget_s,
            rollback_script=config.paths.rollback if step.rolls_back else None,
        )
        engines.settings_kept(
            name=f"Settings {step.engine.name} serves kept",
            kept_dir=config.paths.kept(step.engine.name),
            files=config.paths.engine_files(step.engine.name),
            wanted=KeptSettings(
                step.engine.name,
                int(time.time()),
                config.pin(step.engine).venv,
                config.checkpoint_dir(step.engine),
                step.settings,
            ),
            current=step.kept,
            previous=step.engine.name in snapshot.previous,
            rolled_back=step.engine.name in snapshot.rollbacks,
        )
        _caches_keyed(config, snapshot, plan, step)
    # A rank's caches are valid once its head served (the operation above, on the head's host).
    for step in plan.worker_steps:
        _caches_keyed(config, snapshot, plan, step)


def _caches_keyed(
    config: HostConfig, snapshot: Snapshot, plan: converge.ConvergePlan, step: converge.EngineStep
) -> None:
    jit.cache_keyed(
        name=f"JIT caches of {step.engine.name} keyed",
        config=config,
        engine=step.engine,
        key=plan.cache_keys[step.engine.name],
        snapshot=snapshot,
        rebuilt=step.stale,
    )


def _services_running(config: HostConfig, snapshot: Snapshot, plan: converge.ConvergePlan) -> None:
    """The services after the engines: an engine that moved behind the front has freed the port
    nginx takes over. Each service restarts (or reloads) when the files it runs with differ from
    what it last loaded."""
    front.worker_connections(
        name=f"nginx: {config.front_connections} connections per worker",
        path=layout.NGINX_MAIN_CONFIG,
        wanted=config.front_connections,
        current=snapshot.worker_connections,
    )
    for service in plan.services:
        SERVICE_OPERATIONS[service.service](name=service.name, **service.arguments)


def _finished(config: HostConfig, snapshot: Snapshot, plan: converge.ConvergePlan) -> None:
    """The engines target, what no engine needs any more, and last the host record."""
    if plan.engines_target:
        engines.target_reached(
            name=f"{layout.ENGINES_TARGET} reached",
            unit=layout.ENGINES_TARGET,
            current=snapshot.engines.get(layout.ENGINES_TARGET),
            engines_started=bool(plan.started),
        )
    checkpoints.old_revisions_removed(name="Remove old checkpoint revisions", config=config, snapshot=snapshot)
    venv.unused_venvs_removed(name="Remove unused vLLM venvs", config=config, snapshot=snapshot)
    host_record.host_recorded(
        name="Host record",
        config=config,
        current=snapshot.record,
        started=plan.started,
        planned=plan.record,
        textfile=snapshot.paths.get(config.monitoring.record_textfile),
    )
