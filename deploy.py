"""Converge one Spark (or the sandbox): packages, user, folders, the pinned vLLM venv, checkpoints,
rendered scripts and units, then the engines, started one at a time in `after` order.

    pyinfra inventory/spark.py deploy.py --dry --diff
    pyinfra inventory/spark.py deploy.py

The host's data is validated again here (after --data overrides) before any operation is added,
so a bad value stops the run before anything on the host changes. Every decision is taken from
one fact (SparkformHost), gathered in one round trip.
"""

from pyinfra import host, logger

from facts.host import SparkformHost
from sparkform import bootchain, hostrecord
from sparkform.hub import resolve_pins
from sparkform.inventory import exit_invalid, exit_untrusted, host_from_data
from sparkform.render import (FRONT_CONFIG, FRONT_DROP_IN, FRONT_UNIT, GUARD_UNIT, guard_files, prerequisite_packages,
                              render_host)
from sparkform.schema import ENGINES_TARGET, UNIT_PREFIX
from sparkform.model import InventoryError
from tasks import checkpoints, engines, files, front, guard, jit, system, venv
from tasks import record as record_ops

UNIT_GLOB = f"/etc/systemd/system/{UNIT_PREFIX}*.service"

try:
    config = host_from_data(host.name, host.data.dict()).config
except InventoryError as err:
    exit_invalid(err, f"data of host {host.name}")

secrets = files.secrets(config)
unwanted = files.unwanted(config)
folders = system.folders(config)
packages = prerequisite_packages(config.device)
snapshot = host.get_fact(
    SparkformHost,
    packages=packages,
    users=[config.engine_user],
    paths=([f.path for f in folders] + [f.path for f in render_host(config)] + [s.path for s in secrets]
           + unwanted),
    markers=[venv.marker_path(config), files.applied_stamp(config, "nginx"), files.applied_stamp(config, "guard")],
    units=[engine.unit for engine in config.engines] + [ENGINES_TARGET, FRONT_UNIT, GUARD_UNIT],
    unit_glob=UNIT_GLOB,
    models_dir=config.models_dir,
    pins_dir=config.pins_dir,
    cache_root=config.cache_root,
    cache_keys_dir=hostrecord.cache_keys_dir(config.state_dir),
    record_path=hostrecord.record_path(config.state_dir),
)
# Root acts on nothing it did not write: a pin, key, marker or record of another shape stops
# the run here, before any change (and before the hub is asked about a pin).
if snapshot.untrusted:
    exit_untrusted(host.name, snapshot.untrusted)
# Branches and tags become commits: the host's record of them, else the hub's answer now.
try:
    config = config.pinned(resolve_pins(host.name, config, snapshot.pins))
except InventoryError as err:
    exit_invalid(err, f"data of host {host.name}")
rendered = render_host(config)
changed = {f.path for f in rendered if files.differs(f.content, snapshot.paths.get(f.path))}
order = bootchain.start_order(config)

# What changed since the last converge, and which engines' JIT caches it made stale.
live = hostrecord.parse_live_versions(snapshot.live_versions, f"{config.vllm_package}-{config.vllm_version}")
record = snapshot.record
drift = hostrecord.drift(record, live, {e.name: snapshot.cache_keys.get(e.name) for e in order},
                         {e.name for e in order if jit.caches_aside(config, e, snapshot)})
last_cold = hostrecord.last_cold_starts(record, {e.name: e.measured.cold_start_s for e in order})
drift_lines = hostrecord.drift_report(drift, last_cold)
for line in drift_lines:
    logger.warning(f"[{host.name}] since the last converge: {line}")
# The boot chain: an edge to a unit that is not enabled orders nothing (docs/incidents.md#boot-chain-hole).
changed_units = {f.path.rsplit("/", 1)[-1] for f in rendered if f.is_unit and f.path in changed}
for unit, dep, state in bootchain.holes({u: s.after for u, s in snapshot.engines.items()
                                         if s.unit_file_state == "enabled"}, snapshot.unit_files):
    repaired = bootchain.hole_repaired(unit, dep, order, changed_units)
    logger.warning(f"[{host.name}] boot chain: {unit} waits for {dep}, which is {state}: "
                   + ("this run repairs it" if repaired else "fix that unit by hand"))

system.packages_present(name="Install prerequisites", packages=packages, snapshot=snapshot)
system.system_user(name=f"Engine user {config.engine_user}", user=config.engine_user,
                   home=config.engine_home, snapshot=snapshot)
for spec in folders:
    system.folder(name=f"Folder {spec.path}", spec=spec, snapshot=snapshot)
for secret in secrets:
    files.managed_file(name=f"Secret {secret.path}", path=secret.path, content=secret.content,
                       mode=secret.mode, group=secret.group, current=snapshot.paths.get(secret.path),
                       secret=True)
for path in unwanted:
    files.removed(name=f"No {path}", path=path, current=snapshot.paths.get(path))

def put_files(selected: list) -> None:
    for file in selected:
        files.managed_file(name=f"File {file.path}", path=file.path, content=file.content,
                           mode=file.mode, current=snapshot.paths.get(file.path))


# Shared scripts first (the checkpoint fetch is one of them). Each engine's unit and settings
# only once its venv and checkpoint are complete: a failed fetch leaves the engine pointed at
# the revision it serves, and the next run still sees its settings as changed.
put_files([f for f in rendered if f.engine is None])
# A human hears of the drift even if a start below fails.
if drift_lines:
    guard.alerted(name="Alert: drift since the last converge", lib_dir=config.lib_dir, event="drift",
                  message="; ".join(drift_lines))
venv.wheelhouse_synced(name="Wheelhouse on the host", config=config, snapshot=snapshot)
venv.vllm_venv(name=f"vLLM venv {venv.pin(config)}", config=config, snapshot=snapshot)
for engine in config.enabled_engines:
    checkpoints.checkpoint(name=f"Checkpoint of {engine.name}: {engine.checkpoint.repo} "
                                f"{engine.checkpoint.revision} -> {config.commit(engine)}",
                           config=config, engine=engine, snapshot=snapshot)
put_files([f for f in rendered if f.engine is not None])

# Units sparkform wrote for engines that have left the inventory.
leftovers = sorted(snapshot.rendered_units - {f.path for f in rendered if f.is_unit})
for unit_path in leftovers:
    name = unit_path.rsplit("/", 1)[-1].removeprefix(UNIT_PREFIX).removesuffix(".service")
    engines.engine_removed(name=f"Remove engine {name} (no longer in the inventory)", unit_path=unit_path,
                           settings=list(config.settings_files(name)))

engines.daemon_reload(name="Reload systemd units",
                      needed=bool(leftovers) or any(f.is_unit and f.path in changed for f in rendered))
for engine in config.engines:
    if not engine.enabled:
        engines.engine_stopped(name=f"Stop disabled engine {engine.name}", engine=engine,
                               current=snapshot.engines.get(engine.unit))
# Stale caches aside before any engine starts: no cold start beside another one.
for engine in order:
    if engine.name in drift.stale_engines:
        jit.cache_moved_aside(name=f"JIT caches of {engine.name} aside (stale)", config=config, engine=engine,
                              snapshot=snapshot)
# One at a time, in `after` order: each `systemctl start` returns when its engine serves.
started: dict[str, bool] = {}  # engine -> whether its start rebuilds its caches
for engine in order:
    current = snapshot.engines.get(engine.unit)
    restart = engine.name in drift.stale_engines or any(
        f.engine == engine.name and f.path in changed for f in rendered)
    if engines.starts(current, restart):
        started[engine.name] = engine.name in drift.stale_engines or engine.name not in snapshot.cache_keys
    engines.engine_running(name=f"Engine {engine.name} serving", engine=engine, current=current, restart=restart)
    jit.cache_keyed(name=f"JIT caches of {engine.name} keyed", config=config, engine=engine,
                    key=hostrecord.cache_key(live), snapshot=snapshot, rebuilt=engine.name in drift.stale_engines)
# The front last: an engine that moved behind it has freed the port nginx takes over. nginx and
# the guard restart (or reload) when the files they run with differ from what they last loaded.
contents = {f.path: f.content for f in rendered} | {s.path: s.content for s in secrets}
front_key = contents.get(config.front_key_path, "")
front_stamp = files.applied_stamp(config, "nginx")
front.front_serving(name="Front (nginx) serving", address=config.listen_address,
                    ports=[engine.port for engine in order], current=snapshot.engines.get(FRONT_UNIT),
                    applied=snapshot.markers.get(front_stamp), stamp=front_stamp,
                    wanted=f"{files.digest(contents[FRONT_DROP_IN])} {files.digest(contents[FRONT_CONFIG], front_key)}")
guard_stamp = files.applied_stamp(config, "guard")
guard.guard_running(name="Guard (watchdog, memory guard, alerts) running", unit=GUARD_UNIT,
                    current=snapshot.engines.get(GUARD_UNIT), applied=snapshot.markers.get(guard_stamp),
                    wanted=files.digest(*(contents[path] for path in guard_files(config))), stamp=guard_stamp)
if order:
    engines.target_reached(name=f"{ENGINES_TARGET} reached", unit=ENGINES_TARGET,
                           current=snapshot.engines.get(ENGINES_TARGET), engines_started=bool(started))
checkpoints.old_revisions_removed(name="Remove old checkpoint revisions", config=config, snapshot=snapshot)
record_ops.host_recorded(name="Host record", config=config, current=record, started=started,
                         planned=record_ops.planned_record(config, live, record, snapshot))
