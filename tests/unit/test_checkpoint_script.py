"""sparkform-checkpoint, the rendered fetch-and-prove script, against the fake hub on 127.0.0.1:
it verifies sha256 against the hub's tree, re-fetches what differs, refuses a corrupt hub and a
full disk with the numbers, and writes the manifest and the marker only when all matched."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sparkform.inventory import load_host
from sparkform.layout import COMPLETE_MARKER
from sparkform.render import render_host
from sparkform.sandbox.fakehub import FakeHub
from sparkform.sandbox.models import TINY_MODELS, cached_checkpoint
from sparkform.schema import HostConfig
from tasks.checkpoints import _fetch

QWEN = "sparkform-test/tiny-qwen3"  # two weight shards
SHARD = "model-00001-of-00002.safetensors"


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    rendered = {f.path: f for f in render_host(HostConfig())}
    path = tmp_path_factory.mktemp("lib") / "sparkform-checkpoint"
    path.write_text(rendered["/usr/local/lib/sparkform/sparkform-checkpoint"].content)
    return path


@pytest.fixture
def hub(tmp_path: Path, tmp_path_factory):
    build = tmp_path_factory.getbasetemp() / "checkpoint-builds"
    with FakeHub(tmp_path / "hub") as running:
        for repo_id, kind in TINY_MODELS.items():
            running.add_repo(repo_id, cached_checkpoint(kind, build))
        yield running


def fetch(script: Path, hub: FakeHub, folder: Path, repo: str = QWEN) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if not key.startswith("HF_")}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(folder.parent / "hf-home"), HF_TOKEN="hf_test_token")
    return subprocess.run(
        [sys.executable, str(script), repo, "main", str(folder)], env=env, capture_output=True, text=True, timeout=120
    )


def test_fetch_verifies_and_writes_manifest_and_marker_last(script, hub, tmp_path):
    folder = tmp_path / "ckpt"
    result = fetch(script, hub, folder)
    assert result.returncode == 0, result.stderr
    commit = hub.resolve(QWEN, "main")
    assert (folder / COMPLETE_MARKER).read_text() == f"{commit}\n"
    manifest = json.loads((folder / ".sparkform-manifest.json").read_text())
    served = hub.repo_dir(QWEN) / commit
    assert manifest["commit"] == commit
    assert {entry["path"] for entry in manifest["files"]} == {p.name for p in served.iterdir()}
    shard = next(entry for entry in manifest["files"] if entry["path"] == SHARD)
    assert (folder / SHARD).read_bytes() == (served / SHARD).read_bytes()
    assert shard["size"] == (served / SHARD).stat().st_size
    assert any(request["authorization"] for request in hub.requests)  # the token was sent


def test_a_flipped_byte_is_detected_and_fetched_again(script, hub, tmp_path):
    folder = tmp_path / "ckpt"
    assert fetch(script, hub, folder).returncode == 0
    shard = folder / SHARD
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    (folder / COMPLETE_MARKER).unlink()
    result = fetch(script, hub, folder)
    assert result.returncode == 0, result.stderr
    assert f"{SHARD}: sha256 differs from the hub's; fetching it again" in result.stderr
    commit = hub.resolve(QWEN, "main")
    assert shard.read_bytes() == (hub.repo_dir(QWEN) / commit / SHARD).read_bytes()


def test_a_hub_that_serves_a_corrupt_file_leaves_no_marker(script, hub, tmp_path):
    hub.corrupt_file(QWEN, SHARD)
    folder = tmp_path / "ckpt"
    result = fetch(script, hub, folder)
    assert result.returncode == 4
    assert f"{SHARD} of {QWEN}@" in result.stderr and "after a second fetch" in result.stderr
    assert not (folder / COMPLETE_MARKER).exists()


def test_a_full_disk_is_refused_with_the_numbers_before_any_byte(script, hub, tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(small)], check=True)
    try:
        result = fetch(script, hub, small / "ckpt")
        assert result.returncode == 3
        assert "needs 0.01 GiB plus 2 GiB of margin" in result.stderr and "GiB free" in result.stderr
        assert not any(p.suffix == ".safetensors" for p in (small / "ckpt").rglob("*"))
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_the_deploy_s_fetch_command_keeps_the_token_out_of_every_argv(script, hub, tmp_path):
    """Run the fetch commands the checkpoint operation yields, as the remote shell would, under
    strace: the token reaches the hub (every request authorized) but no process's argv."""
    token = "hf_secret_4a7c1e"
    config = load_host(
        "box",
        {
            "lib_dir": str(tmp_path / "lib"),
            "config_dir": str(tmp_path / "etc"),
            "venv_root": str(tmp_path / "venvs"),
            "models_dir": str(tmp_path / "models"),
            "hf_endpoint": hub.url,
            "engines": [{"name": "q", "port": 8000, "checkpoint": {"repo": QWEN, "revision": "main"}}],
        },
    ).config.pinned({"q": hub.resolve(QWEN, "main")})
    (engine,) = config.engines
    config = config.model_copy(update={"hf_token_file": "token-on-the-laptop"})
    Path(config.lib_dir).mkdir()
    shutil.copy(script, f"{config.lib_dir}/sparkform-checkpoint")
    Path(config.paths.hf_token).parent.mkdir(parents=True)
    Path(config.paths.hf_token).write_text(f"{token}\n")
    python = Path(config.venv) / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    folder = config.checkpoint_dir(engine)
    env = {key: value for key, value in os.environ.items() if not key.startswith("HF_")}
    env["HF_HOME"] = str(tmp_path / "hf-home")
    trace = tmp_path / "execve.log"
    for command in _fetch(config, engine, folder, drifted=False):
        result = subprocess.run(
            ["strace", "-f", "-qq", "-e", "trace=execve", "-s", "65535", "-o", str(trace), "sh", "-c", command],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, (command, result.stderr[-2000:])
        execs = trace.read_text()
        assert "execve(" in execs
        assert token not in execs, f"the token is in an argv: {command}"
    assert Path(folder, COMPLETE_MARKER).is_file()
    fetched = [entry for entry in hub.requests if entry["method"] == "GET" and "/resolve/" in entry["path"]]
    assert fetched and all(entry["authorization"] for entry in fetched)
