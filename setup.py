"""The wheel carries the deploy: setuptools reads everything else from pyproject.toml.

A checkout keeps deploy.py, tasks/, facts/, templates/, locks/, inventory/ and the verify suite
(tests/verify) beside the package; the wheel holds copies of them under sparkform/bundled/, so a
`pip install .` (or from a git URL) has a working `sparkform` and no top-level `tasks` or `facts`
package. sparkform/bundle.py finds them in either place.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
BUNDLED = ("deploy.py", "tasks", "facts", "templates", "locks", "inventory", "tests/verify")


class BuildPyWithDeploy(build_py):
    """build_py, then the deploy's files into the wheel's sparkform/bundled/ (not for an editable
    install, which finds them in the checkout)."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        target = Path(self.build_lib) / "sparkform" / "bundled"
        shutil.rmtree(target, ignore_errors=True)  # nothing left over from an earlier build
        for name in BUNDLED:
            source, copy = HERE / name, target / name
            copy.parent.mkdir(parents=True, exist_ok=True)
            if source.is_dir():
                shutil.copytree(source, copy, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy2(source, copy)


setup(cmdclass={"build_py": BuildPyWithDeploy})
