"""Which xdist worker runs what (`make test` runs the suite on TEST_WORKERS workers).

Each integration module is a chain of its own, and the modules that share a sandbox
(SHARES_SANDBOX) are one chain together: a chain runs on one worker, in file order, so its
module-scoped sandbox and its tests' order hold as in a serial run. Chains go out longest first,
by the minutes each module declares (CI_MINUTES), so the longest starts at once; every unit test
is a unit of its own, taken by whichever worker is free. A module's constants are read from its
source (the controller never imports a test module).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
INTEGRATION = "tests/integration/"
SHARED_CHAIN = "shared-sandbox"


@functools.cache
def declared(module: str) -> dict[str, object]:
    """The literal top-level constants of module file `module` (a path relative to the repo)."""
    values: dict[str, object] = {}
    for node in ast.parse((REPO / module).read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                values[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return values


def chain(nodeid: str) -> str | None:
    """The chain of a test (by its node id), or None for a unit test."""
    module = nodeid.split("::", 1)[0]
    if not module.startswith(INTEGRATION):
        return None
    return SHARED_CHAIN if declared(module).get("SHARES_SANDBOX") else Path(module).stem


def chain_minutes(nodeids: list[str]) -> dict[str, float]:
    """Each chain's minutes: the sum of its modules' CI_MINUTES (a module must declare them)."""
    minutes: dict[str, float] = {}
    for module in {nodeid.split("::", 1)[0] for nodeid in nodeids if chain(nodeid)}:
        if "CI_MINUTES" not in declared(module):
            raise ValueError(f"{module} declares no CI_MINUTES (its wall time in CI, tests/chains.py)")
        name = chain(module)
        minutes[name] = minutes.get(name, 0) + declared(module)["CI_MINUTES"]
    return minutes


def longest_first(items: list) -> None:
    """Sort pytest items in place: the chains by their minutes, longest first, then the unit
    tests; the order within a chain and among the unit tests stays."""
    minutes = chain_minutes([item.nodeid for item in items])
    items.sort(key=lambda item: -minutes.get(chain(item.nodeid), -1))


class ChainScheduler:
    """The xdist plugin: its scheduler hands out chains and unit tests as the work units."""

    def pytest_xdist_make_scheduler(self, config, log):
        from xdist.scheduler import LoadScopeScheduling

        class ChainScheduling(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return chain(nodeid) or nodeid

            def _reschedule(self, node) -> None:
                """xdist hands a worker its next unit while 2 of its tests are left; a chain
                waits until only the one the worker holds is (it runs a test once it knows the
                next), so a worker that finishes first takes it."""
                if node.shutting_down or not self.workqueue:
                    return super()._reschedule(node)
                next_is_chain = "::" not in next(iter(self.workqueue))
                if next_is_chain and self._pending_of(self.assigned_work[node]) > 1:
                    return None
                return super()._reschedule(node)

        return ChainScheduling(config, log)
