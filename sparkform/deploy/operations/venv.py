"""The pinned vLLM venvs: one per hashed lock, each built once, never taken as complete when half-built."""

from __future__ import annotations

import shlex
from pathlib import Path

from pyinfra import host
from pyinfra.api import FileUploadCommand, operation
from pyinfra.facts.files import FindFiles

from sparkform.deploy.operations.files import replaced_file
from sparkform.deploy.operations.progress import ProgressCommand, printf_line, ticking
from sparkform.domain.layout import venv_install_log, venv_lock, venv_marker
from sparkform.domain.locks import VllmPin, read_lock
from sparkform.domain.schema import HostConfig
from sparkform.readers.snapshot import Snapshot


def own_pattern(text: str) -> str:
    """A `pkill -f` pattern for `text` that does not match the shell running pkill (whose
    command line holds the pattern itself): the first character goes into brackets."""
    return f"[{text[0]}]{text[1:]}"


def pip_install_args(config: HostConfig, pin: VllmPin) -> list[str]:
    """pip arguments that install exactly the lock: every file is checked against the lock's
    hashes before anything is installed, wheels only, nothing resolved; offline from the
    wheelhouse, or from the configured indexes."""
    if config.wheelhouse:
        source = ["--no-index", "--find-links", config.wheelhouse]
    else:
        source = ["--index-url", config.pip_index_url] if config.pip_index_url else []
        for url in config.pip_extra_index_urls:
            source += ["--extra-index-url", url]
    return ["--require-hashes", "--no-deps", "--only-binary=:all:", *source, "-r", venv_lock(pin.venv)]


def venv_is_current(pin: VllmPin, snapshot: Snapshot) -> bool:
    return snapshot.markers.get(venv_marker(pin.venv)) == pin.requirement


@operation()
def wheelhouse_synced(config: HostConfig, snapshot: Snapshot):
    """
    Copy the wheels the host lacks from `wheelhouse_source` into `wheelhouse`, only when a venv
    is about to be built (a no-op run never lists the folder).

    + config: the host's validated configuration
    + snapshot: the host's state from the HostSnapshot fact
    """
    wheelhouse = config.wheelhouse
    if not config.wheelhouse_source or wheelhouse is None or all(venv_is_current(pin, snapshot) for pin in config.pins):
        host.noop("no venv to build")
        return
    present = {path.rsplit("/", 1)[-1] for path in host.get_fact(FindFiles, path=wheelhouse) or []}
    missing = sorted(wheel for wheel in Path(config.wheelhouse_source).glob("*.whl") if wheel.name not in present)
    if not missing:
        host.noop(f"{wheelhouse} holds every wheel")
        return
    yield f"install -d -m 755 {shlex.quote(wheelhouse)}"
    for wheel in missing:
        yield FileUploadCommand(str(wheel), f"{wheelhouse}/{wheel.name}")


def install_command(config: HostConfig, pin: VllmPin, packages: int) -> str:
    """pip installing the lock into the venv, its output in the venv's install log; meanwhile a
    line every PROGRESS_EVERY_S seconds counts the wheels pip collected (its `Collecting`/`Processing`
    lines) and the packages in site-packages, out of the lock's `packages`; on a failure the
    log's end goes to stderr."""
    venv = shlex.quote(pin.venv)
    log = shlex.quote(venv_install_log(pin.venv))
    pip_args = " ".join(shlex.quote(arg) for arg in pip_install_args(config, pin))
    count_dist_infos = f"ls -d {venv}/lib/python3*/site-packages/*.dist-info 2>/dev/null | wc -l"
    pip = f"{venv}/bin/pip install --disable-pip-version-check --progress-bar off {pip_args} >>{log} 2>&1"
    tick = printf_line(
        f"venv: %s of {packages} wheels collected, %d installed (%d s)",
        f"\"$(grep -c -e '^Collecting ' -e '^Processing ' {log})\"",
        f'"$(($({count_dist_infos}) - before))"',
        "$elapsed",
    )
    failed = printf_line("sparkform: pip failed (exit %d); the end of %s:", "$rc", log)
    done = printf_line(
        f"venv: {packages} packages installed in %d s (pip's log: %s)", '"$(($(date +%s) - started))"', log
    )
    return (
        f"(umask 077 && : >{log}); before=$({count_dist_infos}); {ticking(pip, tick)} "
        f"|| {{ rc=$?; {failed} >&2; tail -n 30 {log} >&2; exit $rc; }}; {done}"
    )


def build_commands(config: HostConfig, pin: VllmPin):
    """The commands that build `pin`'s venv from its lock, in order (an upload is a FileUploadCommand)."""
    venv = shlex.quote(pin.venv)
    lock = shlex.quote(venv_lock(pin.venv))
    # A deploy cut off mid-install can leave its pip running on the host: stop it first.
    yield f"pkill -f -- {shlex.quote(own_pattern(pin.venv + '/bin/pip'))} || true"
    yield f"rm -rf {venv}"
    yield f"{shlex.quote(config.python)} -m venv {venv}"
    yield FileUploadCommand(pin.lock, venv_lock(pin.venv))
    yield f"chown root:root {lock}"
    yield f"chmod 644 {lock}"
    yield ProgressCommand(install_command(config, pin, len(read_lock(Path(pin.lock).read_text())[0])))
    yield replaced_file(venv_marker(pin.venv), pin.requirement)


@operation()
def vllm_venv(config: HostConfig, pin: VllmPin, snapshot: Snapshot):
    """
    Build the venv of a pinned vLLM from its hashed lock unless its completion marker already
    names the pin.

    The lock lands in the venv (root's, 0644) and pip installs exactly it: a file whose hash
    differs from the lock's stops pip before anything is installed. The marker is written last,
    so a venv cut off halfway (killed deploy, full disk, a hash mismatch) is removed and built
    again rather than used.

    + config: the host's validated configuration
    + pin: the vLLM to install (`HostConfig.pin`): package, version, lock and venv
    + snapshot: the host's state from the HostSnapshot fact
    """
    if venv_is_current(pin, snapshot):
        host.noop(f"{pin.requirement} already installed in {pin.venv}")
        return
    yield from build_commands(config, pin)


def unused_venvs(config: HostConfig, snapshot: Snapshot) -> list[str]:
    """The venvs under venv_root that neither the host's tools nor an enabled engine runs, and that
    no kept settings set names (an engine's last served ones, or those before: a rollback's)."""
    named = {pin.venv for pin in config.pins} | {
        kept.venv for kept in [*snapshot.kept.values(), *snapshot.previous.values()]
    }
    return [path for name in snapshot.venvs if (path := f"{config.venv_root}/{name}") not in named]


@operation()
def unused_venvs_removed(config: HostConfig, snapshot: Snapshot):
    """
    Remove the venvs nothing runs or may go back to (`unused_venvs`): a vLLM an engine moved away
    from stays while its kept settings name it. Runs after every engine serves.

    + config: the host's validated configuration
    + snapshot: the host's state from the HostSnapshot fact
    """
    unused = unused_venvs(config, snapshot)
    if not unused:
        host.noop("no unused venv")
        return
    for path in unused:
        yield f"rm -rf -- {shlex.quote(path)}"
