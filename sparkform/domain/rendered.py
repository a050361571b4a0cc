"""A file as sparkform puts it on a host (rendered from templates/ or a program of sparkform.host)."""

from __future__ import annotations

from dataclasses import dataclass

from sparkform.domain import layout


@dataclass(frozen=True)
class RenderedFile:
    path: str
    content: str
    mode: str
    engine: str | None = None  # the engine that must restart when this file changes

    @property
    def is_unit(self) -> bool:
        """systemd reads it: a unit file or a drop-in."""
        return layout.is_unit_path(self.path)


@dataclass(frozen=True)
class Secret:
    """A secret as sparkform puts it on a host (never shown in a diff or a log)."""

    path: str
    content: str
    mode: str
    group: str
