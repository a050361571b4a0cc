"""Prerequisites: Debian packages, the engine user, and the folders everything lives in."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import PurePosixPath

from pyinfra import host
from pyinfra.api import operation

from facts.host import HostSnapshot
from sparkform.hostrecord import cache_keys_dir, record_dir
from sparkform.render import FRONT_DROP_IN
from sparkform.schema import HostConfig

@dataclass(frozen=True)
class Folder:
    path: str
    mode: str
    user: str = "root"
    group: str = "root"


def folders(config: HostConfig) -> list[Folder]:
    """Every folder the deploy manages, parents first. Root reads back and runs only what lies
    in root's folders; the engine user owns exactly its home, the launch locks and each
    engine's cache folder, none of which holds a folder of root's, so it can rename or replace
    nothing root trusts."""
    engine_user = config.engine_user
    result = [
        Folder(config.lib_dir, "755"),
        Folder(config.config_dir, "755"),
        Folder(f"{config.config_dir}/engines", "755"),
        # Secrets are root's: the front (nginx's master) reads the key, the deploy the HF token.
        Folder(f"{config.config_dir}/secrets", "700"),
        Folder(config.state_dir, "755"),
        Folder(config.engine_home, "750", engine_user, engine_user),
        Folder(config.lock_dir, "755", engine_user, engine_user),
        Folder(record_dir(config.state_dir), "755"),
        Folder(cache_keys_dir(config.state_dir), "755"),
        Folder(config.venv_root, "755"),
        # Checkpoints belong to root: an engine can read its weights, never change them.
        Folder(config.models_dir, "755"),
        Folder(config.pins_dir, "755"),
        Folder(config.cache_root, "755"),
        Folder(str(PurePosixPath(FRONT_DROP_IN).parent), "755"),
    ]
    result += [Folder(config.engine_cache_dir(engine), "750", engine_user, engine_user)
               for engine in config.engines]
    return result


@operation()
def packages_present(packages: list[str], snapshot: HostSnapshot):
    """
    Install the Debian packages that are missing; refresh the package lists only if needed.

    + packages: package names
    + snapshot: the host's state from the SparkformHost fact
    """
    missing = [name for name in packages if name not in snapshot.installed_packages]
    if not missing:
        host.noop("packages already installed")
        return
    install = ("DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "
               + " ".join(shlex.quote(name) for name in missing))
    yield f"{install} || {{ apt-get update && {install} ; }}"


@operation()
def system_user(user: str, home: str, snapshot: HostSnapshot):
    """
    Create the system user the engines run as.

    + user: user name (its group has the same name)
    + home: home folder (caches that ignore XDG land here)
    + snapshot: the host's state from the SparkformHost fact
    """
    if snapshot.users.get(user) == home:
        host.noop(f"user {user} exists")
        return
    if user in snapshot.users:
        # Its home moved out of the (now root's) state folder.
        yield f"usermod --home {shlex.quote(home)} {shlex.quote(user)}"
        return
    yield (f"useradd --system --user-group --home-dir {shlex.quote(home)} --no-create-home "
           f"--shell /usr/sbin/nologin {shlex.quote(user)}")


@operation()
def folder(spec: Folder, snapshot: HostSnapshot):
    """
    Make a folder with its mode and owner.

    + spec: path, mode, user and group of the folder
    + snapshot: the host's state from the SparkformHost fact
    """
    current = snapshot.paths.get(spec.path)
    path = shlex.quote(spec.path)
    if current is None:
        yield f"install -d -m {spec.mode} -o {shlex.quote(spec.user)} -g {shlex.quote(spec.group)} {path}"
        return
    if current.mode != spec.mode:
        yield f"chmod {spec.mode} {path}"
    if (current.user, current.group) != (spec.user, spec.group):
        yield f"chown {shlex.quote(f'{spec.user}:{spec.group}')} {path}"
    if (current.mode, current.user, current.group) == (spec.mode, spec.user, spec.group):
        host.noop(f"folder {spec.path} is in place")
