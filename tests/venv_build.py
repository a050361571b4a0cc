"""The deploy's venv build (sparkform.deploy.operations.venv.build_commands), run outside pyinfra: in a folder of this
machine (tests/unit/test_locks.py) or in a container of the sandbox's rootfs (tests/venv_image.py)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable

from pyinfra.api import FileUploadCommand, StringCommand

from sparkform.deploy.operations import venv
from sparkform.domain.locks import VllmPin
from sparkform.domain.schema import HostConfig


def run_build_commands(
    config: HostConfig,
    pin: VllmPin,
    shell: Callable[[str], subprocess.CompletedProcess],
    put: Callable[[str, str], object],
) -> subprocess.CompletedProcess:
    """Run the venv operation's commands in order, each shell command through `shell`, each upload
    through `put(source, destination)`; the result of the first that fails, else pip's."""
    pip = None
    for command in venv.build_commands(config, pin):
        if isinstance(command, FileUploadCommand):
            put(command.src, command.dest)
            continue
        text = command.get_raw_value() if isinstance(command, StringCommand) else command
        result = shell(text)
        if result.returncode:
            return result
        if "pip install" in text:
            pip = result
    assert pip is not None, "the venv build has no pip install"
    return pip
