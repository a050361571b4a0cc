"""How `make test` splits the suite over xdist workers (tests/chains.py): every integration module
one chain, the modules that share a sandbox one chain together, chains longest first by their
declared minutes, unit tests each on their own; a real xdist run keeps a chain on one worker."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import chains
import pytest
from chains import SHARED_CHAIN, chain, chain_minutes, declared, longest_first

INTEGRATION = chains.REPO / "tests" / "integration"


def test_integration_modules_declare_minutes_and_sharing_ones_form_a_chain():
    modules = sorted(p.relative_to(chains.REPO).as_posix() for p in INTEGRATION.glob("test_*.py"))
    minutes = chain_minutes([f"{module}::test" for module in modules])
    sharing = [m for m in modules if declared(m).get("SHARES_SANDBOX")]
    assert sharing, "no module shares the sandbox"
    assert {chain(m) for m in sharing} == {SHARED_CHAIN}
    assert minutes[SHARED_CHAIN] == sum(declared(m)["CI_MINUTES"] for m in sharing)
    assert {chain(m) for m in modules if m not in sharing} == {Path(m).stem for m in modules if m not in sharing}
    assert chain("tests/unit/test_render.py::test_x") is None


def test_chains_go_longest_first_then_the_unit_tests_each_keeping_order(monkeypatch):
    monkeypatch.setattr(
        chains,
        "declared",
        lambda module: {
            "tests/integration/test_a.py": {"CI_MINUTES": 5, "SHARES_SANDBOX": True},
            "tests/integration/test_b.py": {"CI_MINUTES": 9},
            "tests/integration/test_c.py": {"CI_MINUTES": 6, "SHARES_SANDBOX": True},
        }[module],
    )
    order = [
        "tests/unit/test_u.py::one",
        "tests/integration/test_a.py::first",
        "tests/integration/test_a.py::second",
        "tests/integration/test_b.py::only",
        "tests/unit/test_u.py::two",
        "tests/integration/test_c.py::last",
    ]
    items = [SimpleNamespace(nodeid=nodeid) for nodeid in order]
    longest_first(items)
    assert [item.nodeid for item in items] == [
        "tests/integration/test_a.py::first",  # the shared chain: 5 + 6 minutes
        "tests/integration/test_a.py::second",
        "tests/integration/test_c.py::last",
        "tests/integration/test_b.py::only",
        "tests/unit/test_u.py::one",
        "tests/unit/test_u.py::two",
    ]


def test_a_module_without_its_minutes_is_refused(monkeypatch):
    monkeypatch.setattr(chains, "declared", lambda module: {})
    with pytest.raises(ValueError, match="tests/integration/test_x.py declares no CI_MINUTES"):
        chain_minutes(["tests/integration/test_x.py::t"])


def test_under_xdist_a_chain_runs_on_one_worker_and_unit_tests_spread(tmp_path):
    """A throwaway project laid out as this one, run by real xdist with the chain scheduler."""
    (tmp_path / "tests" / "integration").mkdir(parents=True)
    (tmp_path / "tests" / "unit").mkdir()
    worker = "import os, time\n\ndef test_{n}():\n    time.sleep(0.2)\n    print(os.environ['PYTEST_XDIST_WORKER'])\n"
    for module, constants in (
        ("test_a", "SHARES_SANDBOX = True\n"),
        ("test_b", ""),
        ("test_c", "SHARES_SANDBOX = True\n"),
    ):
        body = "".join(worker.format(n=n) for n in range(3))
        (tmp_path / "tests" / "integration" / f"{module}.py").write_text(f"CI_MINUTES = 1\n{constants}{body}")
    (tmp_path / "tests" / "unit" / "test_u.py").write_text("".join(worker.format(n=n) for n in range(6)))
    (tmp_path / "tests" / "conftest.py").write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(chains.REPO / "tests")!r})
            import chains
            chains.REPO = __import__("pathlib").Path({str(tmp_path)!r})

            def pytest_configure(config):
                config.pluginmanager.register(chains.ChainScheduler(), "chains")
            """
        )
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "3", "--dist", "loadscope", "--no-loadscope-reorder", "-v", "-p",
         "no:cacheprovider", "--rootdir", str(tmp_path), "tests"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    placed: dict[str, set[str]] = {}
    for line in run.stdout.splitlines():
        if line.startswith("[gw") and " PASSED " in line:
            module = line.split(" PASSED ")[1].split("::")[0]
            placed.setdefault(module, set()).add(line[1:4])
    shared = placed["tests/integration/test_a.py"] | placed["tests/integration/test_c.py"]
    assert len(shared) == 1 and len(placed["tests/integration/test_b.py"]) == 1, placed
    assert len(placed["tests/unit/test_u.py"]) > 1, placed
