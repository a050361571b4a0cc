"""The rehearsal stage: a sandbox host plus what it needs from the control machine.

`up` boots the host with the offline wheelhouse bound read-only at WHEELHOUSE_IN_GUEST, starts
the fake hub on the host side of its link, and writes throwaway secrets (an HF token and an API
key) so the deploy exercises the secret paths for real. `down` undoes all of it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from sparkform.render import prerequisite_packages
from sparkform.sandbox import host
from sparkform.sandbox.wheelhouse import build_wheelhouse

WHEELHOUSE_IN_GUEST = "/srv/wheelhouse"
HUB_PORT = 8088
HUB_START_TIMEOUT_S = 60.0


def hub_url(box: host.Sandbox) -> str:
    return f"http://{box.host_address}:{HUB_PORT}"


def secret_file(box_runtime: Path, name: str) -> Path:
    return box_runtime / "secrets" / name


def _write_secrets(runtime: Path) -> None:
    folder = runtime / "secrets"
    folder.mkdir(mode=0o700, exist_ok=True)
    for name in ("hf_token", "api_key"):
        path = folder / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(f"sf-{name.replace('_', '-')}-{secrets.token_hex(16)}\n")


def _start_hub(box: host.Sandbox) -> None:
    log = (box.runtime_dir / "hub.out").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "sparkform.sandbox.fakehub", "--root", str(box.runtime_dir / "hub"),
         "--host", box.host_address, "--port", str(HUB_PORT), "--log", str(box.runtime_dir / "hub.log")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    (box.runtime_dir / "hub.pid").write_text(f"{process.pid}\n")
    deadline = time.monotonic() + HUB_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise host.SandboxError(f"the fake hub exited {process.returncode}: "
                                    f"{(box.runtime_dir / 'hub.out').read_text()[-2000:]}")
        with contextlib.suppress(OSError), socket.create_connection((box.host_address, HUB_PORT), timeout=1):
            return
        time.sleep(0.1)
    raise host.SandboxError(f"the fake hub did not listen on {hub_url(box)} within {HUB_START_TIMEOUT_S:.0f} s")


def _stop_hub(runtime: Path) -> None:
    pid_file = runtime / "hub.pid"
    if not pid_file.exists():
        return
    with contextlib.suppress(ProcessLookupError, ValueError):
        os.killpg(int(pid_file.read_text()), signal.SIGTERM)


def up(name: str = "sandbox") -> host.Sandbox:
    """Wheelhouse and rootfs (both cached), the host, its fake hub and its secrets."""
    wheelhouse = build_wheelhouse()
    # The guest reaches no registry: the deploy's prerequisites are baked into the rootfs.
    box = host.up(name, binds=[(str(wheelhouse), WHEELHOUSE_IN_GUEST)],
                  extra_packages=prerequisite_packages("cpu"))
    try:
        _write_secrets(box.runtime_dir)
        _start_hub(box)
    except BaseException:
        down(name)
        raise
    return box


def down(name: str = "sandbox") -> None:
    _stop_hub(host.runtime_dir(name))
    host.down(name)
