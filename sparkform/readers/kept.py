"""The last settings an engine served with, kept on the host so a failed change can go back to them.

Per engine, root keeps a folder (``<state_dir>/record/kept/<engine>/``, 0700, layout.kept_dir)
with copies of the three files the engine runs with (its unit, env and args files) and
``kept.json``: when they were kept, the venv and checkpoint folder they use (never removed while
kept) and the digest of the three files. The deploy writes it once the engine served them (after
its `systemctl start` returned: the readiness helper saw it answer). When a changed engine then
fails its start, ``sparkform-rollback`` (sparkform/host/rollback.py) writes the kept
files back, starts the engine and writes ``rolled-back.json`` beside them: when, why (the
journal's why-lines) and the digest of the settings that failed. The next deploy's plan reads both
(sparkform/deploy/facts/snapshot.py) and, while the inventory still renders the settings that failed, says so.

Pure: parsing and checking what was read back; nothing here opens a connection. Every value is
checked against the shape sparkform writes it in (UntrustedValue otherwise).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import Any

from sparkform.domain.shapes import SAFE_PATH
from sparkform.host import kept as host_kept
from sparkform.host.kept import day
from sparkform.readers.hostrecord import ENGINE_NAME_PATTERN, UntrustedValue

DIGEST = re.compile(r"[0-9a-f]{32}")
# A checkpoint folder: a SAFE_PATH whose last part is owner--name@commit.
CHECKPOINT_FOLDER = re.compile(rf"{SAFE_PATH.pattern}/[A-Za-z0-9][A-Za-z0-9._-]*@[0-9a-f]{{40}}")
# The why-lines of a failed start, joined: printable text (they come from the engine's journal,
# which the engine user writes into), as sparkform-rollback cleans them.
REASON = re.compile(r"[^\x00-\x1f\x7f]{1,1000}")
ROLLERS = ("deploy", "hand")  # who put the kept settings back


def settings_digest(unit: str, env: str, args: str) -> str:
    """The digest of an engine's three files, as sparkform-rollback computes it on the host."""
    return host_kept.settings_digest((unit, env, args))


@dataclass(frozen=True)
class KeptSettings:
    """What an engine last served with.

    + engine: its name
    + since: unix time the deploy kept them (the engine served them then)
    + venv: the vLLM venv they run
    + checkpoint: the checkpoint folder they load
    + digest: settings_digest of the kept unit, env and args files
    """

    engine: str
    since: int
    venv: str
    checkpoint: str
    digest: str

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> KeptSettings:
        """UntrustedValue when `text` is not what the deploy writes."""
        data = _object(text)
        return cls(
            engine=_shaped(data, "engine", ENGINE_NAME_PATTERN),
            since=_unix(data, "since"),
            venv=_shaped(data, "venv", SAFE_PATH),
            checkpoint=_shaped(data, "checkpoint", CHECKPOINT_FOLDER),
            digest=_shaped(data, "digest", DIGEST),
        )


@dataclass(frozen=True)
class Rollback:
    """An engine put back on its kept settings.

    + engine: its name
    + at: unix time it went back
    + by: "deploy" (its start failed) or "hand" (`sparkform rollback`)
    + reason: why (the failed start's journal lines, or what the owner gave)
    + failed: settings_digest of the settings it left
    """

    engine: str
    at: int
    by: str
    reason: str
    failed: str

    @classmethod
    def from_json(cls, text: str) -> Rollback:
        """UntrustedValue when `text` is not what sparkform-rollback writes."""
        data = _object(text)
        by = data.get("by")
        if by not in ROLLERS:
            raise UntrustedValue(f"by {by!r} is not one of {', '.join(ROLLERS)}")
        return cls(
            engine=_shaped(data, "engine", ENGINE_NAME_PATTERN),
            at=_unix(data, "at"),
            by=by,
            reason=_shaped(data, "reason", REASON),
            failed=_shaped(data, "failed", DIGEST),
        )

    def line(self) -> str:
        """The dry-run's line while the inventory renders the settings that went back."""
        return f"{self.engine} runs its previous settings since {day(self.at)}: {self.reason}"


def _object(text: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except ValueError as err:
        raise UntrustedValue(f"not JSON ({err})") from None
    if not isinstance(data, dict):
        raise UntrustedValue("not a JSON object")
    return data


def _shaped(data: dict[str, Any], key: str, pattern: re.Pattern) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise UntrustedValue(f"{key} {value!r} is not what sparkform writes there")
    return value


def _unix(data: dict[str, Any], key: str) -> int:
    value = data.get(key)
    # A bool is an int to Python, never a time.
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UntrustedValue(f"{key} {value!r} is not a unix time")
    return value
