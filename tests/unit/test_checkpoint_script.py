"""sparkform-checkpoint, the rendered fetch-and-prove script, against the fake hub on 127.0.0.1:
it verifies sha256 against the hub's tree, re-fetches what differs, refuses a corrupt hub and a
full disk with the numbers, and writes the manifest and the marker only when all matched."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from pyinfra.api import StringCommand
from script_box import put

from sparkform.deploy.operations.checkpoints import _fetch
from sparkform.domain.layout import COMPLETE_MARKER
from sparkform.domain.schema import HostConfig
from sparkform.host import checkpoint
from sparkform.rules.inventory import load_host
from sparkform.sandbox.fakehub import FakeHub
from sparkform.sandbox.models import TINY_MODELS, cached_checkpoint
from sparkform.writers.programs import code_files, program_files

QWEN = "sparkform-test/tiny-qwen3"  # two weight shards
SHARD = "model-00001-of-00002.safetensors"


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    lib = tmp_path_factory.mktemp("lib")
    config = HostConfig(lib_dir=str(lib))
    put(program_files(config), lib)
    return Path(config.paths.checkpoint)


@pytest.fixture
def hub(tmp_path: Path, tmp_path_factory):
    build = tmp_path_factory.getbasetemp() / "checkpoint-builds"
    with FakeHub(tmp_path / "hub") as running:
        for repo_id, kind in TINY_MODELS.items():
            running.add_repo(repo_id, cached_checkpoint(kind, build))
        yield running


def fetch_env(hub: FakeHub, folder: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("HF_")}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(folder.parent / "hf-home"), HF_TOKEN="hf_test_token")
    return env


def fetch_command(script: Path, repo: str, folder: Path, *options: str) -> list[str]:
    return [sys.executable, str(script), repo, "main", str(folder), *options]


def fetch(script: Path, hub: FakeHub, folder: Path, repo: str = QWEN) -> subprocess.CompletedProcess:
    return subprocess.run(
        fetch_command(script, repo, folder), env=fetch_env(hub, folder), capture_output=True, text=True, timeout=120
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
            "engines": [{"name": "q", "port": 8010, "checkpoint": {"repo": QWEN, "revision": "main"}}],
        },
    ).config.pinned({"q": hub.resolve(QWEN, "main")})
    (engine,) = config.engines
    config = config.model_copy(update={"hf_token_file": "token-on-the-laptop"})
    put(code_files(config), Path(config.lib_dir))
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
        shell = command.get_raw_value() if isinstance(command, StringCommand) else command
        result = subprocess.run(
            ["strace", "-f", "-qq", "-e", "trace=execve", "-s", "65535", "-o", str(trace), "sh", "-c", shell],
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


# --- progress: per file, as the deploy shows it ---------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint_module(script):
    """The fetcher as the host runs it, imported (the installed module is the package's own text)."""
    installed = script.parent / "python" / "sparkform" / "host" / "checkpoint.py"
    assert installed.read_text() == Path(checkpoint.__file__).read_text()
    return checkpoint


def test_progress_lines_give_bytes_rate_and_time_left(checkpoint_module):
    m = checkpoint_module
    gib = 1024**3
    assert m.file_progress(SHARD, 1.2 * gib, 4.8 * gib, 12) == (
        f"{SHARD}: 1.20 GiB of 4.80 GiB (25%), 102.4 MiB/s, 36 s left"
    )
    assert m.file_progress(SHARD, 0, 5 * 1024**2, 10) == f"{SHARD}: 0 B of 5.0 MiB (0%), 0 B/s, time left unknown"
    assert m.file_done("config.json", 2048, 0.5) == "config.json: 2.0 KiB in 0 s (4.0 KiB/s)"
    assert [m.duration(s) for s in (44.4, 725, 6000)] == ["44 s", "12 min 5 s", "1 h 40 min"]
    # A path the hub names is printed escaped when it holds anything but plain characters.
    assert m.shown("sub/model-1.safetensors") == "sub/model-1.safetensors"
    assert m.shown("evil\x1b[2Jname") == "'evil\\x1b[2Jname'"


def test_a_direct_write_the_filesystem_refuses_goes_through_the_page_cache(checkpoint_module, tmp_path):
    """A direct write the filesystem refuses (EINVAL: here a buffer off the alignment it wants) is
    written all the same: O_DIRECT goes off for the rest of the file."""
    m = checkpoint_module
    path = tmp_path / "part"
    data = os.urandom(3 * 4096)
    with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o666), "wb", buffering=0) as handle:
        m.direct_writes(handle, True)
        assert fcntl.fcntl(handle, fcntl.F_GETFL) & os.O_DIRECT  # tmp_path's filesystem has O_DIRECT
        m.write_all(handle, memoryview(data)[1:])  # not on a memory boundary the kernel takes: EINVAL
        assert not fcntl.fcntl(handle, fcntl.F_GETFL) & os.O_DIRECT
    assert path.read_bytes() == data[1:]


def test_each_fetched_file_gets_a_line_and_nothing_else_is_printed(script, hub, tmp_path):
    folder = tmp_path / "ckpt"
    result = fetch(script, hub, folder)
    assert result.returncode == 0, result.stderr
    commit = hub.resolve(QWEN, "main")
    files = sorted(p.name for p in (hub.repo_dir(QWEN) / commit).iterdir())
    lines = result.stdout.splitlines()
    assert re.fullmatch(
        rf"sparkform-checkpoint: {QWEN}@{commit[:12]}: {len(files)} files, [\d.]+ MiB to fetch", lines[0]
    )
    done = [
        re.fullmatch(r"sparkform-checkpoint: \[(\d+)/(\d+)\] (\S+): [\d.]+ [KMG]?i?B in \d+ s \(.+/s\)", line)
        for line in lines[1:-1]
    ]
    assert all(done), lines
    # Files download side by side, so they finish in any order: each once, with its own number.
    assert sorted((int(m[1]), int(m[2]), m[3]) for m in done) == [
        (n, len(files), name) for n, name in enumerate(files, 1)
    ]
    assert lines[-1] == f"sparkform-checkpoint: {QWEN}@{commit} complete: {len(files)} files verified"
    # A second run fetches nothing, and says so in one line.
    (folder / COMPLETE_MARKER).unlink()
    again = fetch(script, hub, folder)
    assert again.stdout.splitlines()[0].endswith(f"{len(files)} files, 0 B to fetch")
    assert len(again.stdout.splitlines()) == 2


def test_a_slow_download_gets_a_progress_line_every_few_seconds(script, hub, tmp_path):
    hub.stall()  # bodies pause after their first chunk: the shards stall, the small files do not
    process = subprocess.Popen(
        fetch_command(script, QWEN, tmp_path / "ckpt", "--progress-every", "0.5"),
        env=fetch_env(hub, tmp_path / "ckpt"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
    reader.start()
    progress = rf"sparkform-checkpoint: \[\d+/\d+\] {SHARD}: .+ of .+ \(\d+%\), .+/s, .+\n"
    try:
        deadline = time.monotonic() + 60
        while sum(bool(re.fullmatch(progress, line)) for line in list(lines)) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        hub.stall(False)
    process.wait(timeout=120)
    reader.join(timeout=10)  # the reader alone reads stdout, to its end
    assert process.returncode == 0, process.stderr.read()
    assert sum(bool(re.fullmatch(progress, line)) for line in lines) >= 3, lines
    # Then the line that says it is done, after its progress lines.
    done = [
        n for n, line in enumerate(lines) if re.match(rf"sparkform-checkpoint: \[\d+/\d+\] {SHARD}: \S+ \w+ in ", line)
    ]
    assert done and all(n < done[0] for n, line in enumerate(lines) if re.fullmatch(progress, line))


# --- parallel files, one hash per byte, blob ids, resumes, a disk that fills ---------------------

SHARD2 = "model-00002-of-00002.safetensors"
PROGRESS = re.compile(r"sparkform-checkpoint: \[\d+/\d+\] (\S+): .+ of .+ \(\d+%\), .+/s, .+")


class Running:
    """The script running in the background, its stdout read line by line as it comes."""

    def __init__(self, script: Path, hub: FakeHub, folder: Path, *options: str) -> None:
        self.process = subprocess.Popen(
            fetch_command(script, QWEN, folder, *options),
            env=fetch_env(hub, folder),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True)
        self.reader.start()

    def downloading(self) -> set[str]:
        """The files that progress lines have named so far."""
        return {m[1] for line in list(self.lines) if (m := PROGRESS.fullmatch(line.rstrip("\n")))}

    def wait_for(self, condition, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.1)

    def finish(self) -> tuple[int, str]:
        stderr = self.process.stderr.read()
        self.process.wait(timeout=120)
        self.reader.join(timeout=10)
        return self.process.returncode, stderr


@pytest.mark.parametrize("workers", [1, 2])
def test_files_download_side_by_side_up_to_the_worker_count(script, hub, tmp_path, workers):
    hub.stall()  # the shards stall after their first chunk, so those in flight stay in flight
    running = Running(script, hub, tmp_path / "ckpt", "--workers", str(workers), "--progress-every", "0.3")
    # Only the shards stall: a small file a worker fetched whole may have been named meanwhile.
    stalled = {SHARD, SHARD2}
    try:
        running.wait_for(lambda: len(running.downloading() & stalled) >= workers)
        time.sleep(1.5)  # a worker more than allowed would show up by now
        in_flight = running.downloading() & stalled
    finally:
        hub.stall(False)
    returncode, stderr = running.finish()
    assert returncode == 0, stderr
    assert len(in_flight) == workers, in_flight


def test_a_downloaded_file_is_never_read_back(script, hub, tmp_path):
    """Its bytes are hashed as they stream in; the manifest and the comparison take that digest."""
    folder = tmp_path / "ckpt"
    trace = tmp_path / "openat.log"
    command = ["strace", "-f", "-qq", "-e", "trace=openat", "-o", str(trace), *fetch_command(script, QWEN, folder)]
    result = subprocess.run(command, env=fetch_env(hub, folder), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    opens = [line for line in trace.read_text().splitlines() if ".safetensors" in line]
    assert any("O_WRONLY" in line and f"{SHARD}.part" in line for line in opens), opens
    assert not [line for line in opens if "O_RDONLY" in line or "O_RDWR" in line], opens
    manifest = json.loads((folder / ".sparkform-manifest.json").read_text())
    served = hub.repo_dir(QWEN) / hub.resolve(QWEN, "main")
    for entry in manifest["files"]:
        assert entry["sha256"] == hashlib.sha256((served / entry["path"]).read_bytes()).hexdigest()


def test_a_fetched_shard_leaves_no_page_in_the_page_cache(script, hub, tmp_path):
    """Its bytes go from the read buffer to the disk (O_DIRECT), all but its last block: a 40 GB
    checkpoint neither crowds the page cache nor pays for new page-cache pages as it streams in."""
    folder = tmp_path / "ckpt"
    result = fetch(script, hub, folder)
    assert result.returncode == 0, result.stderr
    resident = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(folder / SHARD)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert int(resident) <= 4096, resident


def test_a_file_git_stores_is_compared_by_its_blob_id_not_its_size_alone(script, hub, tmp_path):
    folder = tmp_path / "ckpt"
    assert fetch(script, hub, folder).returncode == 0
    config = folder / "config.json"
    config.write_text(config.read_text().replace('"', "'", 1).replace('"', "'", 1))  # same size
    (folder / COMPLETE_MARKER).unlink()
    result = fetch(script, hub, folder)
    assert result.returncode == 0, result.stderr
    assert "config.json: git blob id differs from the hub's; fetching it again" in result.stderr
    assert config.read_bytes() == (hub.repo_dir(QWEN) / hub.resolve(QWEN, "main") / "config.json").read_bytes()


def shard_gets(hub: FakeHub, name: str = SHARD) -> list[dict]:
    return [r for r in hub.requests if r["method"] == "GET" and r["path"].endswith(f"/{name}")]


def test_a_cut_download_resumes_where_it_stopped(script, hub, tmp_path):
    served = hub.repo_dir(QWEN) / hub.resolve(QWEN, "main") / SHARD
    total = served.stat().st_size
    cut_at = total * 9 // 10
    hub.cut(SHARD, cut_at)
    folder = tmp_path / "ckpt"
    result = fetch(script, hub, folder)
    assert result.returncode == 0, result.stderr
    gets = shard_gets(hub)
    assert [(r["range"], r["sent"]) for r in gets] == [(None, cut_at), (f"bytes={cut_at}-", total - cut_at)]
    assert f"{SHARD}: cut after 3.8 MiB (IncompleteRead(" in result.stderr
    assert (folder / SHARD).read_bytes() == served.read_bytes()
    assert not (folder / ".partial").exists()


def test_a_resumed_file_that_mismatches_is_fetched_again_from_its_start(script, hub, tmp_path):
    folder = tmp_path / "ckpt"
    served = hub.repo_dir(QWEN) / hub.resolve(QWEN, "main") / SHARD
    (folder / ".partial").mkdir(parents=True)
    (folder / ".partial" / f"{SHARD}.part").write_bytes(b"\0" * (served.stat().st_size // 2))  # not the hub's bytes
    result = fetch(script, hub, folder)
    assert result.returncode == 0, result.stderr
    assert f"{SHARD}: sha256 differs from the hub's after a resume; fetching it from its start" in result.stderr
    assert [r["range"] for r in shard_gets(hub)] == [f"bytes={served.stat().st_size // 2}-", None]
    assert (folder / SHARD).read_bytes() == served.read_bytes()


def hub_file(hub: FakeHub, folder: Path, monkeypatch) -> tuple[checkpoint.Fetch, bytes, str]:
    """(the fetcher's Fetch of the hub's shard into `folder`, its bytes, its commit), its URLs the fake hub's."""
    commit = hub.resolve(QWEN, "main")
    served = (hub.repo_dir(QWEN) / commit / SHARD).read_bytes()
    monkeypatch.setattr(
        checkpoint, "hf_hub_url", lambda repo, path, revision: f"{hub.url}/{repo}/resolve/{revision}/{path}"
    )
    monkeypatch.setattr(checkpoint, "build_hf_headers", lambda: {"authorization": "Bearer hf_test_token"})
    entry = SimpleNamespace(
        path=SHARD, size=len(served), lfs=SimpleNamespace(sha256=hashlib.sha256(served).hexdigest())
    )
    return checkpoint.Fetch(1, entry, folder), served, commit


def test_fetcher_called_directly_resumes_from_bytes_an_earlier_run_left(hub, tmp_path, monkeypatch):
    """Fetch.download, imported: the bytes in .partial/ (ending mid-block) are kept, the rest asked
    for as a range, and the file moved in place whole."""
    fetch, served, commit = hub_file(hub, tmp_path / "ckpt", monkeypatch)
    kept = len(served) // 3 + 1  # not on a 4 KiB block boundary: the resume rewrites that block
    fetch.partial.parent.mkdir(parents=True)
    fetch.partial.write_bytes(served[:kept])
    assert fetch.resumable() == kept
    fetch.download(QWEN, commit, "[1/1]", threading.Event())
    assert [(r["range"], r["sent"]) for r in shard_gets(hub)] == [(f"bytes={kept}-", len(served) - kept)]
    assert fetch.local.read_bytes() == served and not fetch.partial.exists()
    assert fetch.digests.mismatch(fetch.entry) is None


def test_fetcher_called_directly_fetches_again_what_a_resume_made_wrong(hub, tmp_path, monkeypatch):
    fetch, served, commit = hub_file(hub, tmp_path / "ckpt", monkeypatch)
    fetch.partial.parent.mkdir(parents=True)
    fetch.partial.write_bytes(b"\0" * 5000)  # not the hub's bytes
    fetch.download(QWEN, commit, "[1/1]", threading.Event())
    assert [r["range"] for r in shard_gets(hub)] == ["bytes=5000-", None]
    assert fetch.local.read_bytes() == served


def test_a_full_disk_mid_fetch_ends_with_the_numbers_and_next_run_resumes(script, hub, tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(small)], check=True)
    try:
        folder = small / "ckpt"
        hub.stall()
        running = Running(script, hub, folder, "--margin-gib", "0", "--progress-every", "0.3")
        try:
            running.wait_for(lambda: {SHARD, SHARD2} <= running.downloading())
            with open(small / "filler", "wb") as filler:  # something else takes the rest of the disk
                with pytest.raises(OSError):
                    while True:
                        filler.write(b"\0" * 65536)
                        filler.flush()
        finally:
            hub.stall(False)
        returncode, stderr = running.finish()
        assert returncode == 3, stderr
        assert "Traceback" not in stderr, stderr
        assert re.search(
            rf"{QWEN}@\w+: the disk filled while \S+ was written into {folder}: .+ still to fetch, "
            r".+ free; free space there or move models_dir",
            stderr,
        ), stderr
        assert not (folder / COMPLETE_MARKER).exists() and not (folder / SHARD).exists()
        # Room again: the next run resumes what was written.
        (small / "filler").unlink()
        kept = (folder / ".partial" / f"{SHARD}.part").stat().st_size
        hub.clear_requests()
        result = subprocess.run(
            fetch_command(script, QWEN, folder, "--margin-gib", "0"),
            env=fetch_env(hub, folder),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert [r["range"] for r in shard_gets(hub)] == [f"bytes={kept}-"]
        assert (folder / COMPLETE_MARKER).is_file()
    finally:
        subprocess.run(["umount", str(small)], check=True)


@pytest.mark.parametrize(
    "hostile",
    [
        "../escape",
        "../../etc/sparkform-escape",
        "/tmp/sparkform-absolute",
        "a/../../x",
        "./config.json",
        "a//b",
        "sub/\x1b[2Jx",
        COMPLETE_MARKER,
        ".partial/x.part",
    ],
)
def test_a_tree_entry_outside_the_folder_is_refused_before_any_write(script, hub, tmp_path, hostile):
    """A hostile mirror (its hashes are its own too): the fetch exits 5 naming the entry, and
    nothing inside or outside the checkpoint folder was created or changed."""
    hub.list_only(QWEN, hostile, like=SHARD)
    work = tmp_path / "work"
    folder = work / "models" / "ckpt"
    folder.mkdir(parents=True)
    (folder / "kept").write_text("before\n")
    (work / "escape").write_text("before\n")
    before = sorted((p, p.read_bytes() if p.is_file() else None) for p in work.rglob("*"))
    result = fetch(script, hub, folder)
    assert result.returncode == 5, result.stdout + result.stderr
    assert ascii(hostile) in result.stderr and "nothing was fetched or changed" in result.stderr
    assert sorted((p, p.read_bytes() if p.is_file() else None) for p in work.rglob("*")) == before
    assert not Path("/tmp/sparkform-absolute").exists() and not Path("/etc/sparkform-escape").exists()
