"""The suite's sandbox inventory: inventory/sandbox.py without its embedding engine, the pair every
integration module converges (a third engine would cost a start per converge in each of them).
`tests/integration/test_converge.py` converges the whole box once, with inventory/sandbox.py."""

import runpy
from pathlib import Path

from sparkform.inventory import hosts

WHOLE_BOX = Path(__file__).resolve().parents[2] / "inventory" / "sandbox.py"

((name, data),) = runpy.run_path(str(WHOLE_BOX))["sandbox"]
sandbox = hosts({name: {**data, "engines": [e for e in data["engines"] if e["name"] != "embed"]}}, __file__)
