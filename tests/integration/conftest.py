"""A sandbox per test module, brought up fresh and taken down after the module's last test, and the
state most tests need: that sandbox as inventory/sandbox.py converges it.

Every module marks `pytestmark = pytest.mark.usefixtures("converged")`; the tests that need the
fresh, never-converged box instead (a first converge, a deploy killed halfway) are marked
`from_scratch`. So any test runs alone too (`pytest FILE::TEST`): the fixture converges first.
"""

from __future__ import annotations

import os
import uuid

import pytest
from deploy_helpers import CONVERGED, SANDBOX_INVENTORY, mark_converged, pyinfra

from sparkform.sandbox import machine, stage


@pytest.fixture(scope="module")
def box():
    """A fresh sandbox; SPARKFORM_SANDBOX points inventory/sandbox.py at it meanwhile.

    SPARKFORM_TEST_REUSE=NAME runs the module against sandbox NAME, already up and converged,
    and leaves it up: for working on one test without waiting for a fresh converge.
    """
    reuse = os.environ.get("SPARKFORM_TEST_REUSE")
    if reuse:
        os.environ["SPARKFORM_SANDBOX"] = reuse
        CONVERGED.add(reuse)
        yield machine.get(reuse)
        return
    name = f"t-{uuid.uuid4().hex[:6]}"
    os.environ["SPARKFORM_SANDBOX"] = name
    sandbox = stage.up(name)
    try:
        yield sandbox
    finally:
        stage.down(name)
        os.environ.pop("SPARKFORM_SANDBOX", None)


@pytest.fixture
def converged(request, box):
    """The module's sandbox as inventory/sandbox.py converges it; a `from_scratch` test gets the box
    as it is. A test that leaves other state behind restores it itself (converge_back, finally:)."""
    if request.node.get_closest_marker("from_scratch") or box.name in CONVERGED:
        return box
    result = pyinfra(SANDBOX_INVENTORY, "-y")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    mark_converged(box)
    return box
