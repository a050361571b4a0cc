"""A sandbox per test module, brought up fresh and taken down after the module's last test."""

from __future__ import annotations

import os
import uuid

import pytest

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
