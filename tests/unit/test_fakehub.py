"""The fake hub against the real huggingface_hub client, on 127.0.0.1 only."""

from __future__ import annotations

import hashlib
import json
import runpy
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from urllib.error import HTTPError

import pytest
from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub.errors import RemoteEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

from sparkform.sandbox.fakehub import FakeHub
from sparkform.sandbox.models import TINY_MODELS, cached_checkpoint

LLAMA, QWEN = "sparkform-test/tiny-llama", "sparkform-test/tiny-qwen3"
SECRET = "hf_fakehubTestSecretValue0123456789"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def isolated_hf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No token, offline switch or cache from the machine leaks into a test."""
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))


@pytest.fixture(scope="module")
def build_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both tiny checkpoints, built once for the module."""
    cache = tmp_path_factory.mktemp("build")
    for kind in TINY_MODELS.values():
        cached_checkpoint(kind, cache)
    return cache


@pytest.fixture
def hub(tmp_path: Path, build_cache: Path):
    """A running hub holding the tiny models, logging requests to a file."""
    with FakeHub(tmp_path / "hub", log_file=tmp_path / "requests.jsonl") as running:
        for repo_id, kind in TINY_MODELS.items():
            running.add_repo(repo_id, cached_checkpoint(kind, build_cache))
        yield running


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fetch(url: str, method: str = "GET", headers: dict[str, str] | None = None):
    """(status, headers, body) of one plain HTTP request; HTTP errors are answers too."""
    request = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.headers, response.read()
    except HTTPError as err:
        return err.code, err.headers, err.read()


def test_snapshot_download_gets_every_file_with_its_size(hub: FakeHub, tmp_path: Path) -> None:
    commit = hub.resolve(QWEN, "main")
    local = Path(snapshot_download(QWEN, revision="main", local_dir=tmp_path / "dl", endpoint=hub.url, token=False))
    source = hub.repo_dir(QWEN) / commit
    served = sorted(p.name for p in source.iterdir())
    assert "model.safetensors.index.json" in served and len(served) == 7  # two weight shards
    for name in served:
        assert sha256(local / name) == sha256(source / name)


def test_main_resolves_to_the_content_commit(hub: FakeHub) -> None:
    commit = hub.resolve(LLAMA, "main")
    assert len(commit) == 40 and set(commit) <= set("0123456789abcdef")
    assert HfApi(endpoint=hub.url, token=False).model_info(LLAMA, revision="main").sha == commit


def test_the_pair_inventory_pins_the_commit_the_hub_publishes(hub: FakeHub) -> None:
    """inventory/sandbox-pair.py names tiny-qwen3 by its commit (every rank loads the same one):
    the commit every stage's hub serves, as its id comes from the content."""
    pinned = runpy.run_path(str(REPO / "inventory" / "sandbox-pair.py"))["TINY_QWEN3_COMMIT"]
    assert hub.resolve(QWEN, "main") == pinned


def test_tree_lists_lfs_sha256_for_weights(hub: FakeHub) -> None:
    commit = hub.resolve(LLAMA, "main")
    files = {
        f.path: f for f in HfApi(endpoint=hub.url, token=False).list_repo_tree(LLAMA, revision=commit, recursive=True)
    }
    weights = hub.repo_dir(LLAMA) / commit / "model.safetensors"
    assert files["model.safetensors"].lfs.sha256 == sha256(weights)
    assert files["model.safetensors"].size == weights.stat().st_size
    assert files["config.json"].lfs is None
    # The capitalised flag and the path variant are accepted too.
    status, _, body = fetch(f"{hub.url}/api/models/{LLAMA}/tree/main/?recursive=True")
    assert status == 200 and {e["path"] for e in json.loads(body)} == set(files)


def test_head_has_commit_etag_and_length(hub: FakeHub) -> None:
    commit = hub.resolve(LLAMA, "main")
    weights = hub.repo_dir(LLAMA) / commit / "model.safetensors"
    status, headers, body = fetch(f"{hub.url}/{LLAMA}/resolve/main/model.safetensors", method="HEAD")
    assert status == 200 and body == b""
    assert headers["X-Repo-Commit"] == commit
    assert headers["ETag"] == f'"{sha256(weights)}"'
    assert int(headers["Content-Length"]) == weights.stat().st_size


def test_range_request_returns_206_with_those_bytes(hub: FakeHub) -> None:
    commit = hub.resolve(LLAMA, "main")
    data = (hub.repo_dir(LLAMA) / commit / "model.safetensors").read_bytes()
    url = f"{hub.url}/{LLAMA}/resolve/{commit}/model.safetensors"
    status, headers, body = fetch(url, headers={"Range": "bytes=100-199"})
    assert (status, body) == (206, data[100:200])
    assert headers["Content-Range"] == f"bytes 100-199/{len(data)}"
    status, _, body = fetch(url, headers={"Range": "bytes=1000-"})
    assert (status, body) == (206, data[1000:])
    status, headers, _ = fetch(url, headers={"Range": f"bytes={len(data)}-"})
    assert status == 416 and headers["Content-Range"] == f"bytes */{len(data)}"


def test_unknown_repo_revision_and_file_raise_the_hub_errors(hub: FakeHub, tmp_path: Path) -> None:
    with pytest.raises(RepositoryNotFoundError):
        snapshot_download("sparkform-test/no-such-model", local_dir=tmp_path / "x", endpoint=hub.url, token=False)
    with pytest.raises(RevisionNotFoundError):
        snapshot_download(LLAMA, revision="no-such-branch", local_dir=tmp_path / "y", endpoint=hub.url, token=False)
    with pytest.raises(RemoteEntryNotFoundError):
        hf_hub_download(LLAMA, "no-such-file.json", local_dir=tmp_path / "z", endpoint=hub.url, token=False)
    status, headers, _ = fetch(f"{hub.url}/api/models/{LLAMA}/revision/..%2F..%2Fetc")
    assert status == 404 and headers["X-Error-Code"] == "RevisionNotFound"
    assert fetch(f"{hub.url}/api/agent-harnesses")[0] == 404


def test_moved_branch_leaves_a_pinned_commit_alone(hub: FakeHub, tmp_path: Path) -> None:
    old = hub.resolve(LLAMA, "main")
    changed = tmp_path / "changed"
    shutil.copytree(hub.repo_dir(LLAMA) / old, changed)
    (changed / "README.md").write_text("a new commit\n")
    new = hub.add_repo(LLAMA, changed)

    assert new != old and hub.resolve(LLAMA, "main") == new
    pinned = Path(snapshot_download(LLAMA, revision=old, local_dir=tmp_path / "pinned", endpoint=hub.url, token=False))
    assert not (pinned / "README.md").exists()
    moved = Path(snapshot_download(LLAMA, revision="main", local_dir=tmp_path / "main", endpoint=hub.url, token=False))
    assert (moved / "README.md").read_text() == "a new commit\n"
    hub.move_branch(LLAMA, "main", old)
    assert hub.resolve(LLAMA, "main") == old


def test_token_presence_is_recorded_but_never_its_value(hub: FakeHub, tmp_path: Path) -> None:
    snapshot_download(LLAMA, local_dir=tmp_path / "anon", endpoint=hub.url, token=False)
    assert hub.requests and not any(r["authorization"] for r in hub.requests)
    hub.clear_requests()

    snapshot_download(LLAMA, local_dir=tmp_path / "auth", endpoint=hub.url, token=SECRET)
    assert hub.requests and all(r["authorization"] for r in hub.requests)
    assert SECRET not in repr(hub.requests)
    log = (tmp_path / "requests.jsonl").read_text()
    assert log.count('"authorization": true') == len(hub.requests) and SECRET not in log


def test_corrupted_file_keeps_its_size_but_not_its_sha256(hub: FakeHub, tmp_path: Path) -> None:
    commit = hub.resolve(LLAMA, "main")
    original = hub.repo_dir(LLAMA) / commit / "model.safetensors"
    hub.corrupt_file(LLAMA, "model.safetensors")
    local = Path(hf_hub_download(LLAMA, "model.safetensors", local_dir=tmp_path / "bad", endpoint=hub.url, token=False))
    assert local.stat().st_size == original.stat().st_size  # the client's only check passes
    assert sha256(local) != sha256(original)
    tree = HfApi(endpoint=hub.url, token=False).list_repo_tree(LLAMA, revision=commit)
    assert {f.path: f.lfs.sha256 for f in tree if f.lfs} == {"model.safetensors": sha256(original)}

    hub.corrupt_file(LLAMA, "model.safetensors", corrupt=False)
    status, _, body = fetch(f"{hub.url}/{LLAMA}/resolve/main/model.safetensors")
    assert status == 200 and hashlib.sha256(body).hexdigest() == sha256(original)


def test_runs_as_a_process_and_publishes_the_tiny_models(tmp_path: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "sparkform.sandbox.fakehub", "--root", str(tmp_path / "root"), "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        url = process.stdout.readline().split()[-1]
        published = dict(process.stdout.readline().split()[-1].split("@") for _ in TINY_MODELS)
        assert set(published) == set(TINY_MODELS)
        status, _, body = fetch(f"{url}/api/models/{QWEN}/revision/main")
        assert status == 200 and json.loads(body)["sha"] == published[QWEN]
    finally:
        process.terminate()
        assert process.wait(timeout=10) == 0


def test_stalled_hub_holds_a_download_until_released(hub: FakeHub) -> None:
    """A stalled hub keeps a weights download in flight (a test can cut the deploy there)."""
    url = f"{hub.url}/{LLAMA}/resolve/main/model.safetensors"
    hub.stall()
    result: list = []
    fetcher = threading.Thread(target=lambda: result.append(fetch(url)))
    fetcher.start()
    fetcher.join(timeout=1.0)
    assert fetcher.is_alive() and not result, "the stalled download finished"
    started = time.monotonic()
    hub.stall(False)
    fetcher.join(timeout=10)
    status, _, body = result[0]
    assert status == 200 and time.monotonic() - started < 5
    commit = hub.resolve(LLAMA, "main")
    assert body == (hub.repo_dir(LLAMA) / commit / "model.safetensors").read_bytes()


def recorded_gets(hub: FakeHub, count: int) -> list[dict]:
    """The hub's GET records once there are `count`: it records a request after its body went
    out, so a client can hold the whole body a moment before the record is there."""
    deadline = time.monotonic() + 5
    while len(gets := [r for r in hub.requests if r["method"] == "GET"]) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return gets


def test_a_cut_body_stops_short_once_and_huggingface_hub_sees_it(hub: FakeHub, tmp_path: Path) -> None:
    commit = hub.resolve(LLAMA, "main")
    data = (hub.repo_dir(LLAMA) / commit / "model.safetensors").read_bytes()
    url = f"{hub.url}/{LLAMA}/resolve/{commit}/model.safetensors"
    hub.cut("model.safetensors", 1000)
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.headers["Content-Length"] == str(len(data))
        assert response.read(len(data)) == data[:1000]  # then the connection closes
    status, _, body = fetch(url)  # spent: the next body is whole
    assert (status, body) == (200, data)
    assert [r["sent"] for r in recorded_gets(hub, 2)] == [1000, len(data)]
    # huggingface_hub's own download notices the cut and asks again: from the start, as it had handed
    # on no whole chunk of its 10 MB (sparkform-checkpoint resumes from the byte, its own test shows).
    hub.cut("model.safetensors", 1000)
    path = hf_hub_download(
        LLAMA, "model.safetensors", revision=commit, cache_dir=tmp_path / "cache", endpoint=hub.url, token=False
    )
    assert Path(path).read_bytes() == data
    assert [(r["range"], r["sent"]) for r in recorded_gets(hub, 4)][-2:] == [(None, 1000), (None, len(data))]
