"""The core's types: a validated host, a problem with one, and the error that carries them.

A leaf of the core: validation, the planner, the boot chain and the CLI build on it, and it
builds on the schema alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sparkform.domain.schema import HostConfig


@dataclass(frozen=True)
class Problem:
    host: str
    field: str
    value: Any
    message: str
    fix: str
    engine: str | None = None
    # A file only a deploy reads (a secret, a pinned host key) is missing: `sparkform plan` goes on
    # and lists it as what a deploy still needs; the deploy and every command that connects refuse.
    deploy_only: bool = False

    def __str__(self) -> str:
        where = f"{self.host}: engine {self.engine}: " if self.engine else f"{self.host}: "
        return f"{where}{self.field} = {self.value!r}: {self.message}. Fix: {self.fix}."


class InventoryError(ValueError):
    """The inventory cannot be converged; nothing was sent to any host."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("\n".join(str(problem) for problem in problems))


@dataclass
class Host:
    """A validated host: its data, and the config.json of each engine that names one."""

    name: str
    config: HostConfig
    model_configs: dict[str, dict[str, Any]] = field(default_factory=dict)
    needs: list[Problem] = field(default_factory=list)  # what a deploy still needs (loaded for a plan)
