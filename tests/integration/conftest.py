"""A sandbox per test module, brought up fresh and taken down after the module's last test, and the
state most tests need: that sandbox as inventory/sandbox.py converges it.

Every module marks `pytestmark = pytest.mark.usefixtures("converged")`; the tests that need the
fresh, never-converged box instead (a first converge, a deploy killed halfway) are marked
`from_scratch`. So any test runs alone too (`pytest FILE::TEST`): the fixture converges first.

A module that leaves the sandbox as inventory/sandbox.py converges it, and needs no fresh one,
sets `SHARES_SANDBOX = True`: such modules share one sandbox for the session (and one converge),
which saves a boot and a converge each. A module with a `from_scratch` test never shares.
"""

from __future__ import annotations

import contextlib
import os

import pytest
from deploy_helpers import CONVERGED, SANDBOX_INVENTORY, mark_converged, pyinfra
from steady_memory import moving_memory, still_memory
from suite_hygiene import sandbox_name

from sparkform.sandbox import machine, stage

SHARED_GROUP = "shared-sandbox"


def chain(module) -> str:
    """The xdist group a module's tests run in: all of them on one worker, in file order. The
    modules that share a sandbox form one chain (one worker, one sandbox, one converge)."""
    return SHARED_GROUP if getattr(module, "SHARES_SANDBOX", False) else module.__name__


def pytest_collection_modifyitems(items):
    """Each integration module is one xdist group (the sharing modules one together), and the
    groups go out longest first by the minutes each module declares (CI_MINUTES), so the longest
    chain starts at once and the unit tests fill the workers that finish early. Without xdist the
    same order holds: the sharing modules back to back, so their sandbox is up only meanwhile."""
    minutes: dict[str, float] = {}
    for module in {item.module for item in items if item.path.parent.name == "integration"}:
        minutes[chain(module)] = minutes.get(chain(module), 0) + module.CI_MINUTES
    for item in items:
        if chain(item.module) in minutes:
            item.add_marker(pytest.mark.xdist_group(chain(item.module)))
    items.sort(key=lambda item: -minutes.get(chain(item.module), -1))


@contextlib.contextmanager
def fresh_sandbox():
    """A fresh sandbox, taken down afterwards."""
    name = sandbox_name()
    with moving_memory():
        sandbox = stage.up(name)
    try:
        yield sandbox
    finally:
        with moving_memory():
            stage.down(name)


@pytest.fixture(autouse=True)
def steady_memory(request):
    """Each test holds the machine's memory lock: exclusively when marked `still_memory` (it sets
    the memory guard's floors from what is free now), else shared (steady_memory.py)."""
    with still_memory() if request.node.get_closest_marker("still_memory") else moving_memory():
        yield


@pytest.fixture(scope="session")
def shared_box():
    """The sandbox of the modules that set SHARES_SANDBOX."""
    with fresh_sandbox() as sandbox:
        yield sandbox


@pytest.fixture(scope="module")
def box(request):
    """The module's sandbox; SPARKFORM_SANDBOX points inventory/sandbox.py at it meanwhile.

    SPARKFORM_TEST_REUSE=NAME runs the module against sandbox NAME, already up and converged,
    and leaves it up: for working on one test without waiting for a fresh converge.
    """
    reuse = os.environ.get("SPARKFORM_TEST_REUSE")
    with contextlib.ExitStack() as stack:
        if reuse:
            CONVERGED.add(reuse)
            sandbox = machine.get(reuse)
        elif getattr(request.module, "SHARES_SANDBOX", False):
            sandbox = request.getfixturevalue("shared_box")
        else:
            sandbox = stack.enter_context(fresh_sandbox())
        os.environ["SPARKFORM_SANDBOX"] = sandbox.name
        try:
            yield sandbox
        finally:
            os.environ.pop("SPARKFORM_SANDBOX", None)


@pytest.fixture
def converged(request, box):
    """The module's sandbox as inventory/sandbox.py converges it; a `from_scratch` test gets the box
    as it is. A test that leaves other state behind restores it itself (converge_back, finally:)."""
    if request.node.get_closest_marker("from_scratch"):
        assert not getattr(request.module, "SHARES_SANDBOX", False), "a from_scratch test needs a sandbox of its own"
        return box
    if box.name in CONVERGED:
        return box
    result = pyinfra(SANDBOX_INVENTORY, "-y")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    mark_converged(box)
    return box
