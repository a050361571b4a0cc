"""A sandbox per test module, brought up fresh and taken down after the module's last test, and the
state most tests need: that sandbox as the suite's pair inventory converges it (tests/integration/sandbox_pair.py:
inventory/sandbox.py without its embedding engine).

Every module marks `pytestmark = pytest.mark.usefixtures("converged")`; the tests that need the
fresh, never-converged box instead (a first converge, a deploy killed halfway) are marked
`from_scratch`. So any test runs alone too (`pytest FILE::TEST`): the fixture converges first.

A module that leaves the sandbox as the pair inventory converges it, and needs no fresh one,
sets `SHARES_SANDBOX = True`: such modules share one sandbox for the session (and one converge),
which saves a boot and a converge each. A module with a `from_scratch` test never shares.

The shared sandbox, and the own sandbox of a module that sets `VENV_IMAGE = True`, boot with the
vLLM venv already in place (tests/venv_image.py): their first converge finds it current. Only a
module that tests the venv's install itself (test_faults) boots without it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
from chains import longest_first
from deploy_helpers import CONVERGED, SANDBOX_INVENTORY, edited_inventory, mark_converged, pyinfra
from steady_memory import moving_memory, still_memory
from suite_hygiene import sandbox_name
from suite_memory import sandbox_slots
from venv_image import venv_image

from sparkform.sandbox import machine, stage


def pytest_collection_modifyitems(items):
    """The chains longest first, then the unit tests (tests/chains.py): under xdist each chain
    runs on one worker; in one process the modules that share a sandbox still run back to back,
    so it is up only meanwhile."""
    longest_first(items)


@contextlib.contextmanager
def fresh_sandbox(with_venv: bool):
    """A fresh sandbox, with the vLLM venv in place or not, taken down afterwards."""
    name = sandbox_name()
    with sandbox_slots():
        with moving_memory():
            sandbox = stage.up(name, layers=[venv_image()] if with_venv else [])
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
    with fresh_sandbox(with_venv=True) as sandbox:
        yield sandbox


@pytest.fixture(scope="module")
def box(request):
    """The module's sandbox; SPARKFORM_SANDBOX points the sandbox inventories at it meanwhile.

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
            sandbox = stack.enter_context(fresh_sandbox(getattr(request.module, "VENV_IMAGE", False)))
        os.environ["SPARKFORM_SANDBOX"] = sandbox.name
        try:
            yield sandbox
        finally:
            os.environ.pop("SPARKFORM_SANDBOX", None)


@pytest.fixture
def deployed(tmp_path, box):
    """deployed(**changes) deploys the sandbox inventory with edited_inventory's changes and returns
    its path; the sandbox inventory is deployed again at the test's end, passed or failed, so the
    module's next test meets the box converged, not the edit a failed test left deployed."""
    edits = []

    def deploy(**changes) -> Path:
        inventory = edited_inventory(tmp_path, **changes)
        edits.append(inventory)
        result = pyinfra(inventory, "-y")
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return inventory

    yield deploy
    if edits:
        result = pyinfra(SANDBOX_INVENTORY, "-y")
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.fixture
def converged(request, box):
    """The module's sandbox as the pair inventory converges it; a `from_scratch` test gets the box
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
