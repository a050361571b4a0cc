"""The programs sparkform installs on a host, and the modules they share.

Each program (guard, scrub, rollback, record, checkpoint, vllm_serve) lands byte for byte as
LIB_DIR/sparkform-NAME (sparkform.spec.layout.HOST_PROGRAMS) and reads what varies per host from the
rendered settings file beside it (settings_path). They run in the host's system Python (root's:
`python3 -I`) or in the engines' vLLM venv, neither of which has sparkform: standard library
only (the checkpoint fetcher's huggingface_hub comes with the venv), and what they share lies
in this package, installed beside them under LIB_DIR/python (HostPaths.host_modules). `python3
-I` puts no folder of a program on sys.path, so each program, run as the main module, puts that
folder first itself (root's, as every folder root runs from), and writes no bytecode there: the
deploy puts every file of that folder. The core imports the programs' constants from here, so
each is written once.
"""

import os

# How root runs Python on a host: isolated (no environment variable, user site or script folder
# on sys.path that another user could shape).
ROOT_PYTHON = ("/usr/bin/python3", "-I")
# `journalctl MESSAGE_ID=...` lists every alert of every sparkform program (sparkform.host.alerts).
ALERT_MESSAGE_ID = "7d3f5c2a9e8b4f61a0c4d2e6b8f1a3c5"
RETRY_UNIT_PREFIX = "sparkform-retry-"  # the guard's delayed start of ENGINE: sparkform-retry-ENGINE.timer
SETTINGS_SUFFIX = ".json"


def settings_path(program: str) -> str:
    """The settings file the deploy renders beside a program (its path with .json added)."""
    return os.path.abspath(program) + SETTINGS_SUFFIX
