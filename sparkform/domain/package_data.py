"""Where the package's own data lies: the deploy file pyinfra runs, the templates, the locks, the
shipped inventories and the verify suite. All of it is package data, so a checkout, an editable
install and a wheel find it at the same place. templates/ and inventory/ stay at the top of a
checkout, where pyinfra users look for them; the package reaches them through links of its own.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]
DEPLOY = PACKAGE / "deploy" / "deploy.py"
TEMPLATES = PACKAGE / "templates"
LOCKS = PACKAGE / "locks"
INVENTORIES = PACKAGE / "inventories"
VERIFY_SUITE = PACKAGE / "verify"
