"""Converge one Spark (or the sandbox): packages, user, folders, the pinned vLLM venv, checkpoints,
rendered scripts and units, then the engines, started one at a time in `after` order.

    pyinfra inventory/spark.py deploy.py --dry --diff
    pyinfra inventory/spark.py deploy.py

The host's data is validated again here (after --data overrides) before any operation is added,
so a bad value stops the run before anything on the host changes. Every decision is taken from
one fact (SparkformHost), gathered in one round trip.
"""

from pyinfra import host

from facts.host import SparkformHost
from sparkform.inventory import exit_invalid, host_from_data
from sparkform.render import prerequisite_packages, render_host
from sparkform.schema import UNIT_PREFIX
from sparkform.validate import InventoryError, start_order
from tasks import checkpoints, engines, files, system, venv

UNIT_GLOB = f"/etc/systemd/system/{UNIT_PREFIX}*.service"

try:
    config = host_from_data(host.name, host.data.dict()).config
except InventoryError as err:
    exit_invalid(err, f"data of host {host.name}")

rendered = render_host(config)
secrets = files.secrets(config)
folders = system.folders(config)
packages = prerequisite_packages(config.device)
snapshot = host.get_fact(
    SparkformHost,
    packages=packages,
    users=[config.engine_user],
    paths=[f.path for f in folders] + [f.path for f in rendered] + [s.path for s in secrets],
    markers=[venv.marker_path(config)] + [checkpoints.marker_path(config, e) for e in config.engines],
    units=[engine.unit for engine in config.engines],
    unit_glob=UNIT_GLOB,
    checkpoints=[config.checkpoint_dir(engine) for engine in config.engines],
)

system.packages_present(name="Install prerequisites", packages=packages, snapshot=snapshot)
system.system_user(name=f"Engine user {config.engine_user}", user=config.engine_user,
                   home=config.state_dir, snapshot=snapshot)
for spec in folders:
    system.folder(name=f"Folder {spec.path}", spec=spec, snapshot=snapshot)
for secret in secrets:
    files.managed_file(name=f"Secret {secret.path}", path=secret.path, content=secret.content,
                       mode=secret.mode, group=secret.group, current=snapshot.paths.get(secret.path),
                       secret=True)

# Scripts before the venv and checkpoints: the checkpoint fetch is one of them.
changed = {f.path for f in rendered if files.differs(f.content, snapshot.paths.get(f.path))}
for file in rendered:
    files.managed_file(name=f"File {file.path}", path=file.path, content=file.content,
                       mode=file.mode, current=snapshot.paths.get(file.path))

venv.wheelhouse_synced(name="Wheelhouse on the host", config=config, snapshot=snapshot)
venv.vllm_venv(name=f"vLLM venv {venv.pin(config)}", config=config, snapshot=snapshot)
for engine in config.enabled_engines:
    checkpoints.checkpoint(name=f"Checkpoint of {engine.name}", config=config, engine=engine,
                           snapshot=snapshot)

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
# One at a time, in `after` order: each `systemctl start` returns when its engine serves.
for engine in start_order(config):
    engines.engine_running(name=f"Engine {engine.name} serving", engine=engine,
                           current=snapshot.engines.get(engine.unit),
                           restart=any(f.engine == engine.name and f.path in changed for f in rendered))
