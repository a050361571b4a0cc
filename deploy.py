"""Converge one Spark (or the sandbox): packages, user, folders, the pinned vLLM venv, checkpoints,
rendered scripts and units, then the engines, started one at a time in `after` order.

    pyinfra inventory/spark.py deploy.py --dry --diff
    pyinfra inventory/spark.py deploy.py

A call of the packaged deploy, tasks.converge.converge_host (which a deploy file of one's own
can call too, and pyinfra runs by import path: `pyinfra inventory/spark.py
tasks.converge.converge_host`).
"""

import sys
from pathlib import Path

# facts/ and tasks/ lie beside this file: importable whatever folder pyinfra runs in.
HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from tasks.converge import converge_host

converge_host()
