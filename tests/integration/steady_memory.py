"""Free memory that holds still for the test that needs it, while xdist workers run other tests.

The memory guard reads the machine's MemAvailable, which every sandbox shares: an engine start,
a sandbox's boot or teardown elsewhere moves it by GiBs. So every integration test, and every
boot and teardown of a sandbox, holds the machine's memory lock shared (`moving_memory`); a test
that sets the guard's floors from what is free now holds it exclusively (`still_memory`), and
the others wait meanwhile. A gate lock makes the exclusive holder's turn come: while it waits
for the shared holders to finish, no new one starts.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator

from sparkform.sandbox import registry
from sparkform.sandbox.system import locked

LOCK = registry.RUNTIME_ROOT / ".test-memory.lock"
GATE = registry.RUNTIME_ROOT / ".test-memory.gate"


@contextlib.contextmanager
def moving_memory() -> Iterator[None]:
    """Held while this process may move the machine's free memory by GiBs."""
    with contextlib.ExitStack() as held:
        with locked(GATE):  # a moment: waits while a still_memory holder waits or runs
            held.enter_context(locked(LOCK, fcntl.LOCK_SH))
        yield


@contextlib.contextmanager
def still_memory() -> Iterator[None]:
    """Held while no other worker's test, boot or teardown runs."""
    with locked(GATE), locked(LOCK):
        yield
