"""The rehearsal stage: a sandbox machine plus what it needs from the control machine.

`up` boots the machine with the offline wheelhouse bound read-only at WHEELHOUSE_IN_GUEST, starts
the fake hub and an alert receiver (the webhook the inventory names) on this machine's side of its
link, writes throwaway secrets (an HF token and an API key) so the deploy exercises the secret
paths for real, and installs the GPU's stand-ins: nvidia-smi (GB10's formats) and NVML (a
libnvidia-ml.so.1 built in the guest, for pynvml), both reading one env file; `set_driver` changes
the driver they report, to rehearse a driver update. `down` undoes all of it; `build` makes the
cached rootfs and wheelhouse ahead of the first `up`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from sparkform.domain.layout import NODE_EXPORTER_PACKAGE
from sparkform.sandbox import machine, registry
from sparkform.sandbox.rootfs import build_rootfs
from sparkform.sandbox.system import SandboxError
from sparkform.sandbox.wheelhouse import build_wheelhouse
from sparkform.writers.render import prerequisite_packages

WHEELHOUSE_IN_GUEST = "/srv/wheelhouse"
HUB_PORT = 8088
ALERTS_PORT = 8089  # the alert receiver, the webhook the sandbox inventory names
SERVICE_START_TIMEOUT_S = 60.0
# The stand-in nvidia-smi ships beside this module; it reads its values from NVIDIA_ENV_IN_GUEST.
# It is installed into each sandbox rather than baked into the rootfs, so changing it does not
# invalidate the cached rootfs.
NVIDIA_SMI_SOURCE = Path(__file__).with_name("nvidia-smi")
NVIDIA_SMI_IN_GUEST = "/usr/local/bin/nvidia-smi"
NVIDIA_ENV_IN_GUEST = "/etc/sparkform-sandbox/nvidia.env"
# The NVML stand-in: C source beside this module, compiled in the guest (g++, a deploy
# prerequisite baked into the rootfs, brings cc) into the linker's path, where pynvml's
# CDLL("libnvidia-ml.so.1") finds it; REFRESH_LINKER_CACHE makes the linker see it.
NVML_SOURCE = Path(__file__).with_name("nvml_stand_in.c")
NVML_IN_GUEST = "/usr/local/lib/libnvidia-ml.so.1"
NVML_BUILD_FLAGS = (
    *("-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden"),
    "-Wl,-soname,libnvidia-ml.so.1",
)
REFRESH_LINKER_CACHE = "ldconfig"
# What a DGX Spark (GB10) reported, as captured in tests/fixtures/captured/nvidia-smi-gb10.txt
# (tests/unit/test_nvidia_stand_in.py reads them back from that capture), but the clocks.
DEFAULT_NVIDIA_ENV = {
    "DRIVER_VERSION": "580.95.05",
    "CUDA_VERSION": "13.0",
    "GPU_NAME": "NVIDIA GB10",
    "COMPUTE_CAP": "12.1",
    "GPU_UTILIZATION_PERCENT": "3",
    "GPU_TEMPERATURE_C": "44",
    "GPU_POWER_MW": "12000",  # the capture's 12 W (nvidia-smi prints whole watts)
    # Not in the capture: the ~2400 MHz a healthy GB10 clocks at P0 (a GB10 with a bad power
    # negotiation stays at 500-850 MHz). Replace with `nvidia-smi --query-gpu=clocks.sm,clocks.gr
    # --format=csv` from a Spark once captured.
    "SM_CLOCK_MHZ": "2400",
    "GRAPHICS_CLOCK_MHZ": "2400",
    "CLOCKS_EVENT_REASONS": "0",  # the bitmask of NVML's nvmlClocksEventReason*: none
}
GUEST_COMMAND_TIMEOUT_S = 60.0


def hub_url(box: machine.Sandbox) -> str:
    return f"http://{box.host_address}:{HUB_PORT}"


def secret_file(box_runtime: Path, name: str) -> Path:
    return box_runtime / "secrets" / name


def alerts_file(box_runtime: Path) -> Path:
    """What the alert receiver got, one JSON line each (sparkform.sandbox.alerts.read_alerts)."""
    return box_runtime / "alerts.jsonl"


def _write_secrets(runtime: Path) -> None:
    folder = runtime / "secrets"
    folder.mkdir(mode=0o700, exist_ok=True)
    for name in ("hf_token", "api_key"):
        path = folder / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(f"sf-{name.replace('_', '-')}-{secrets.token_hex(16)}\n")


def _start_service(box: machine.Sandbox, name: str, port: int, argv: list[str]) -> None:
    """Run `python -m argv...` in its own session, listening on this machine's side of the link
    at `port`; `name`.pid and `name`.out in the runtime folder."""
    log = (box.runtime_dir / f"{name}.out").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", *argv], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    (box.runtime_dir / f"{name}.pid").write_text(f"{process.pid}\n")
    deadline = time.monotonic() + SERVICE_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SandboxError(
                f"the sandbox's {name} exited {process.returncode}: "
                f"{(box.runtime_dir / f'{name}.out').read_text()[-2000:]}"
            )
        with contextlib.suppress(OSError), socket.create_connection((box.host_address, port), timeout=1):
            return
        time.sleep(0.1)
    raise SandboxError(
        f"the sandbox's {name} did not listen on {box.host_address}:{port} within {SERVICE_START_TIMEOUT_S:.0f} s"
    )


def _start_hub(box: machine.Sandbox) -> None:
    _start_service(
        box,
        "hub",
        HUB_PORT,
        [
            "sparkform.sandbox.fakehub",
            "--root",
            str(box.runtime_dir / "hub"),
            "--host",
            box.host_address,
            "--port",
            str(HUB_PORT),
            "--log",
            str(box.runtime_dir / "hub.log"),
        ],
    )


def _start_alert_receiver(box: machine.Sandbox) -> None:
    _start_service(
        box,
        "alerts",
        ALERTS_PORT,
        [
            "sparkform.sandbox.alerts",
            "--host",
            box.host_address,
            "--port",
            str(ALERTS_PORT),
            "--out",
            str(alerts_file(box.runtime_dir)),
        ],
    )
    secret = secret_file(box.runtime_dir, "alert_webhook")
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(f"http://{box.host_address}:{ALERTS_PORT}/alerts\n")


def _stop_services(runtime: Path, names: Sequence[str] = ("hub", "alerts")) -> None:
    for name in names:
        pid_file = runtime / f"{name}.pid"
        if pid_file.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.killpg(int(pid_file.read_text()), signal.SIGTERM)


@contextlib.contextmanager
def hub_down(box: machine.Sandbox):
    """The sandbox's hub stopped for the block (nothing listens on its port), then served again."""
    _stop_services(box.runtime_dir, ("hub",))
    deadline = time.monotonic() + SERVICE_START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            socket.create_connection((box.host_address, HUB_PORT), timeout=1).close()
        except OSError:
            break
        time.sleep(0.1)
    try:
        yield
    finally:
        _start_hub(box)


def _guest(box: machine.Sandbox, step: str, command: str, stdin: str = "") -> str:
    """Run a shell command in the guest over SSH (`stdin` fed to it); returns its stdout."""
    try:
        answer = subprocess.run(
            [*box.ssh_args(), command],
            input=stdin,
            capture_output=True,
            text=True,
            check=False,
            timeout=GUEST_COMMAND_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise SandboxError(
            f"{step} in sandbox {box.name!r}: no answer within {GUEST_COMMAND_TIMEOUT_S:.0f} s"
        ) from None
    if answer.returncode != 0:
        raise SandboxError(
            f"{step} in sandbox {box.name!r} failed: `{command}` exited {answer.returncode}: {answer.stderr.strip()}"
        )
    return answer.stdout


def _install_in_guest(box: machine.Sandbox, path: str, content: str, mode: str) -> None:
    """Write `content` to `path` in the guest (root-owned, `mode`, parent folders created)."""
    _guest(box, f"install {path}", f"install -D -m {mode} /dev/stdin {shlex.quote(path)}", content)


def nvidia_env_text(values: dict[str, str]) -> str:
    """The stand-in's env file: one shell-quoted KEY=VALUE line per value (the script sources it)."""
    return "".join(f"{key}={shlex.quote(value)}\n" for key, value in values.items())


def parse_nvidia_env(text: str) -> dict[str, str]:
    """Read back what `nvidia_env_text` wrote (blank lines and comments skipped)."""
    values = {}
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        if words and "=" in words[0]:
            key, _, value = words[0].partition("=")
            values[key] = value
    return values


def nvml_build_command(out: str) -> str:
    """The shell command that compiles the NVML stand-in's source (on stdin) into `out`: by a
    temp file and a rename, so a failed build leaves no half library where pynvml looks."""
    flags = " ".join(NVML_BUILD_FLAGS)
    temp = shlex.quote(f"{out}.new")
    return f"cc {flags} -x c -o {temp} - && mv -f {temp} {shlex.quote(out)} && {REFRESH_LINKER_CACHE}"


def install_nvidia_stand_in(box: machine.Sandbox) -> None:
    """Install the stand-in nvidia-smi and NVML in a running sandbox, reporting DEFAULT_NVIDIA_ENV."""
    _install_in_guest(box, NVIDIA_SMI_IN_GUEST, NVIDIA_SMI_SOURCE.read_text(), "0755")
    _install_in_guest(box, NVIDIA_ENV_IN_GUEST, nvidia_env_text(DEFAULT_NVIDIA_ENV), "0644")
    _guest(box, "build the NVML stand-in", nvml_build_command(NVML_IN_GUEST), NVML_SOURCE.read_text())


def set_driver(box: machine.Sandbox, driver_version: str, cuda_version: str | None = None) -> None:
    """Make the stand-ins report another driver (and CUDA version; None keeps the current one).

    Takes effect at the next nvidia-smi call and the next nvmlInit; reboot the sandbox afterwards to rehearse a driver
    update the way it happens on a Spark.
    """
    values = parse_nvidia_env(_guest(box, "read the stand-in's env file", f"cat {NVIDIA_ENV_IN_GUEST}"))
    values["DRIVER_VERSION"] = driver_version
    if cuda_version is not None:
        values["CUDA_VERSION"] = cuda_version
    _install_in_guest(box, NVIDIA_ENV_IN_GUEST, nvidia_env_text(values), "0644")


# The deploy's prerequisites and what monitoring installs (disabled in the rootfs until a deploy
# with monitoring on enables it): the guest reaches no Debian mirror, so they are baked in.
STAGE_PACKAGES = (*prerequisite_packages("cpu"), NODE_EXPORTER_PACKAGE)


def build() -> tuple[Path, Path]:
    """The wheelhouse and the rootfs that `up` boots, each built unless cached: (rootfs, wheelhouse).

    The guest reaches no registry, so the deploy's prerequisites are baked into the rootfs.
    """
    wheelhouse = build_wheelhouse()
    return build_rootfs(STAGE_PACKAGES), wheelhouse


def up(name: str = "sandbox", binds: Sequence[tuple[str, str]] = (), layers: Sequence[Path] = ()) -> machine.Sandbox:
    """Wheelhouse and rootfs (both cached), the machine, its fake hub and alert receiver, its
    secrets, nvidia-smi and NVML, and a memory controller that enforces the units' ceilings. `binds` are
    further (host path, guest path) pairs bound read-only, beside the wheelhouse; `layers`, folders
    laid read-only over the rootfs (machine.up)."""
    _, wheelhouse = build()
    # The same package list as `build`'s, so this finds the rootfs just built in the cache.
    box = machine.up(
        name, binds=[(str(wheelhouse), WHEELHOUSE_IN_GUEST), *binds], extra_packages=STAGE_PACKAGES, layers=layers
    )
    try:
        _write_secrets(box.runtime_dir)
        _start_hub(box)
        _start_alert_receiver(box)
        install_nvidia_stand_in(box)
        # The units' memory ceilings hold from the start, as on a Spark (and again after a reboot).
        machine.memory_controller_writable(name)
    except BaseException:
        down(name)
        raise
    return box


def down(name: str = "sandbox") -> None:
    """Stop the machine's hub and alert receiver (if it has them), then take the machine down."""
    _stop_services(registry.runtime_dir(name))
    machine.down(name)
