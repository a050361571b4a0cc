"""The sandbox's vLLM venv built once per session's inputs, as an overlay layer that later
sandboxes boot from, so a module that does not test the first install does not pay for it (one
install is minutes of CPU on two cores, and the suite has six sandboxes).

The layer is what the deploy itself would leave: sparkform.deploy.operations.venv.build_commands, run in a container of
the cached rootfs (systemd-nspawn, no boot, the wheelhouse bound where the guest has it), and of
what they wrote only the venv kept. Its name holds a hash of the rootfs, the lock and those
commands, so a change to any of them builds a new one; a build holds a lock (parallel workers
build it once) and is renamed into place only when complete. The deploy then finds the venv's
completion marker and leaves it as it is, exactly as on a host whose venv is current.

Modules that set `VENV_IMAGE = True` boot from it (tests/integration/conftest.py); test_faults
keeps a box without it: its first converge installs the venv for real (and is killed during it).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import time
from pathlib import Path

from pyinfra.api import FileUploadCommand, StringCommand
from venv_build import run_build_commands

from sparkform.deploy.operations import venv
from sparkform.domain.schema import HostConfig
from sparkform.rules.inventory import load_inventory
from sparkform.sandbox import stage
from sparkform.sandbox.rootfs import cache_dir
from sparkform.sandbox.system import SandboxError, locked, remove_tree, run_step, say, unmount_all

SANDBOX_INVENTORY = Path(__file__).resolve().parents[1] / "inventory" / "sandbox.py"
BUILD_TIMEOUT_S = 1200.0


def sandbox_config() -> HostConfig:
    """inventory/sandbox.py's host (the venv does not depend on which sandbox it is)."""
    (host,) = load_inventory(SANDBOX_INVENTORY)
    return host.config


def image_key(rootfs: Path, config: HostConfig) -> str:
    """What the layer depends on: the rootfs it is laid over, the lock, the build's commands."""
    digest = hashlib.sha256(f"{rootfs.name}\n".encode())
    digest.update(Path(config.pin().lock).read_bytes())
    for command in venv.build_commands(config, config.pin()):
        if isinstance(command, FileUploadCommand):
            text = f"upload {command.dest}"  # what it uploads is the lock, hashed above
        else:
            text = command.get_raw_value() if isinstance(command, StringCommand) else command
        digest.update(f"{text}\n".encode())
    return digest.hexdigest()[:16]


def venv_image() -> Path:
    """The layer's folder in the sandbox cache, built first if it is not there."""
    rootfs, wheelhouse = stage.build()
    config = sandbox_config()
    image = cache_dir() / f"venv-image-{image_key(rootfs, config)}"
    if image.is_dir():
        return image
    with locked(cache_dir() / f".{image.name}.lock"):
        if not image.is_dir():  # else another worker built it while this one waited
            _build(image, rootfs, wheelhouse, config)
    return image


def _build(image: Path, rootfs: Path, wheelhouse: Path, config: HostConfig) -> None:
    building = image.with_name(f".building-{image.name}")
    merged = building / "merged"
    unmount_all(building)  # the remains of a build that died (the lock says none runs)
    remove_tree(building)
    for folder in ("upper", "work", "merged"):
        (building / folder).mkdir(parents=True)
    started = time.monotonic()
    say(f"building the sandbox venv layer (vLLM's CPU build from the wheelhouse, ~1.5 min): {image}")
    run_step(
        "mount the venv layer's overlay",
        [
            *("mount", "-t", "overlay", "sparkform-venv-image", "-o"),
            f"lowerdir={rootfs},upperdir={building / 'upper'},workdir={building / 'work'}",
            str(merged),
        ],
    )
    try:
        result = run_build_commands(
            config,
            config.pin(),
            lambda shell: _in_container(merged, wheelhouse, shell),
            lambda source, destination: shutil.copyfile(source, merged / destination.lstrip("/")),
        )
    finally:
        run_step("unmount the venv layer's overlay", ["umount", str(merged)])
    if result.returncode:
        output = result.stdout[-2000:] + result.stderr[-2000:]
        raise SandboxError(f"the venv layer's build failed (exit {result.returncode}): {output}")
    keep_only(building / "upper", config.venv)
    (building / "upper").rename(image)
    remove_tree(building)
    say(f"venv layer ready in {time.monotonic() - started:.0f} s")


def _in_container(root: Path, wheelhouse: Path, shell: str) -> subprocess.CompletedProcess:
    """`sh -c shell` in a container of `root` (its own PID and mount namespaces: the build's
    `pkill` sees only its own processes), the wheelhouse bound where the guest has it."""
    return subprocess.run(
        [
            *("systemd-nspawn", "-q", "--register=no", "--keep-unit", "--as-pid2", "-D", str(root)),
            *("--resolv-conf=off", "--timezone=off", "--link-journal=no"),
            f"--bind-ro={wheelhouse}:{stage.WHEELHOUSE_IN_GUEST}",
            *("sh", "-c", shell),
        ],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )


def keep_only(upper: Path, kept: str) -> None:
    """Remove from the overlay's upper folder everything but `kept` and the folders above it."""
    keep = upper / kept.lstrip("/")
    for folder in [keep.parent, *keep.parent.parents]:
        if folder == upper.parent:
            break
        for entry in folder.iterdir():
            if entry not in (keep, *keep.parents):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
