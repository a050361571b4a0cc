"""The text that lands at the path of every host program (LIB_DIR/sparkform-NAME), byte for byte.

Root runs it as `/usr/bin/python3 -I PATH ARGS`, and a rank of an engine across hosts as the venv's
`python PATH ARGS`. `-I` puts no folder of the program on sys.path, so this puts the shared
modules' folder beside it first (LIB_DIR/python, HostPaths.host_modules: root's, as every folder
root runs from) and writes no bytecode there, since the deploy puts every file of that folder. It
then runs sparkform.host.NAME as the main module: NAME is the path's file name less `sparkform-`,
its dashes read as underscores (sparkform-vllm-serve runs sparkform.host.vllm_serve). alter_sys
makes that module __main__ by its name, so a spawned worker imports it again by that name.
Run under any other name (the spawned worker of a process started before this file replaced
the program), it does nothing.
"""

import os
import runpy
import sys

if __name__ == "__main__":
    folder, name = os.path.split(os.path.abspath(__file__))
    sys.dont_write_bytecode, sys.path[:0] = True, [os.path.join(folder, "python")]
    module = name.removeprefix("sparkform-").replace("-", "_")
    runpy.run_module(f"sparkform.host.{module}", run_name="__main__", alter_sys=True)
