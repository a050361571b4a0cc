"""Where the deploy's own files are: deploy.py, tasks/, facts/, templates/, locks/, inventory/
and the verify suite (tests/verify).

A checkout (and an editable install of it) keeps them beside this package; a wheel carries
copies inside it, in sparkform/bundled/ (setup.py's build step), so that no top-level `tasks`
or `facts` package is installed. A wheel is installed unpacked, so both are plain folders.
Every path to them comes from here.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def _root() -> Path:
    bundled = PACKAGE / "bundled"
    return bundled if (bundled / "deploy.py").is_file() else PACKAGE.parent


ROOT = _root()
DEPLOY = ROOT / "deploy.py"
TEMPLATES = ROOT / "templates"
LOCKS = ROOT / "locks"
INVENTORIES = ROOT / "inventory"
VERIFY_SUITE = ROOT / "tests" / "verify"
