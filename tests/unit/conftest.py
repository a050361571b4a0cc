"""Fixtures of the tests that run the rendered scripts (test_launch_script.py, test_wait_ready.py):
a host rendered into tmp_path, and stand-in engines on 127.0.0.1 (both in script_box.py); and
the fake hub of the deploy's dry runs against this machine (local_deploy.py)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest
from script_box import Box, Staller, build_box, fake_engine
from unix_engines import short_folder

from sparkform.sandbox import stage
from sparkform.sandbox.fakehub import FakeHub


@pytest.fixture
def make_box(tmp_path, socket_dir, free_port) -> Callable[..., Box]:
    def _make(**options: Any) -> Box:
        # The front's ports of the two engines (the engines themselves serve on unix sockets).
        port_a, port_b = free_port(), free_port()
        while port_b == port_a:
            port_b = free_port()
        return build_box(tmp_path, socket_dir, port_a, port_b, **options)

    return _make


@pytest.fixture
def servers():
    """Start fake_engine ("engine") or Staller ("staller") servers; all closed after the test."""
    started: list[Any] = []

    def _start(kind: str = "engine", **kwargs):
        server = fake_engine(**kwargs) if kind == "engine" else Staller(**kwargs)
        started.append(server)
        return server

    yield _start
    for server in started:
        server.close()


@pytest.fixture
def hub(tmp_path):
    """A local fake hub serving org/slow, whose `main` the test may move."""
    with FakeHub(tmp_path / "hub") as running:
        yield running


@pytest.fixture(scope="session")
def nvml_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The NVML stand-in compiled as the sandbox compiles it: the folder that holds libnvidia-ml.so.1."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler (make system-deps installs gcc)")
    folder = tmp_path_factory.mktemp("nvml")
    command = ["cc", *stage.NVML_BUILD_FLAGS, "-o", str(folder / "libnvidia-ml.so.1"), str(stage.NVML_SOURCE)]
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    return folder


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A host's socket_dir: short, as a unix socket's path must be (pytest's tmp_path may not),
    removed with all in it."""
    with short_folder() as folder:
        yield folder
