"""Prerequisites: Debian packages, the engine user, and the folders everything lives in."""

from __future__ import annotations

import shlex

from pyinfra import host
from pyinfra.api import OperationError, operation

from sparkform.readers.snapshot import Snapshot
from sparkform.writers.converge import Folder


@operation()
def packages_present(packages: list[str], snapshot: Snapshot):
    """
    Install the Debian packages that are missing; refresh the package lists only if needed.

    + packages: package names
    + snapshot: the host's state from the HostSnapshot fact
    """
    missing = [name for name in packages if name not in snapshot.installed_packages]
    if not missing:
        host.noop("packages already installed")
        return
    install = "DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends " + " ".join(
        shlex.quote(name) for name in missing
    )
    yield f"{install} || {{ apt-get update && {install} ; }}"


@operation()
def system_user(user: str, home: str, snapshot: Snapshot):
    """
    Create the system user the engines run as.

    + user: user name (its group has the same name)
    + home: home folder (caches that ignore XDG land here)
    + snapshot: the host's state from the HostSnapshot fact
    """
    if snapshot.users.get(user) == home:
        host.noop(f"user {user} exists")
        return
    if user in snapshot.users:
        # Its home moved out of the (now root's) state folder.
        yield f"usermod --home {shlex.quote(home)} {shlex.quote(user)}"
        return
    yield (
        f"useradd --system --user-group --home-dir {shlex.quote(home)} --no-create-home "
        f"--shell /usr/sbin/nologin {shlex.quote(user)}"
    )


@operation()
def folder(spec: Folder, snapshot: Snapshot):
    """
    Make a folder with its mode and owner.

    + spec: path, mode, user and group of the folder
    + snapshot: the host's state from the HostSnapshot fact
    """
    current = snapshot.paths.get(spec.path)
    path = shlex.quote(spec.path)
    if current is not None and current.link:
        # The deploy stops before this (Snapshot.planted_links); never chmod/chown through one.
        raise OperationError(f"{spec.path} is a symbolic link: root follows no link it did not make")
    if current is None:
        yield f"install -d -m {spec.mode} -o {shlex.quote(spec.user)} -g {shlex.quote(spec.group)} {path}"
        return
    if current.mode != spec.mode:
        yield f"chmod {spec.mode} {path}"
    if (current.user, current.group) != (spec.user, spec.group):
        yield f"chown {shlex.quote(f'{spec.user}:{spec.group}')} {path}"
    if (current.mode, current.user, current.group) == (spec.mode, spec.user, spec.group):
        host.noop(f"folder {spec.path} is in place")
