"""Progress on the long steps (the venv build, each checkpoint file, each engine start), shown in
the deploy's output at every verbosity.

pyinfra prints a command's output only from -vvv on, and then every command's. A ProgressCommand
is one command whose output pyinfra prints live, line by line, prefixed with the host's name, at
any verbosity; so such a command prints progress lines only, and keeps its long logs elsewhere.
"""

from __future__ import annotations

import shlex

from pyinfra.api import StringCommand
from pyinfra.connectors.util import CommandOutput

# How often a long step prints a line, at most.
PROGRESS_EVERY_S = 10


class ProgressCommand(StringCommand):
    """A shell command whose output (progress lines, nothing else) pyinfra prints live."""

    def execute(self, state, host, connector_arguments):
        connector_arguments.update(self.connector_arguments)
        status, output = host.run_shell_command(
            self, print_output=True, print_input=state.print_input, **connector_arguments
        )
        # Its lines are on screen already: on a failure pyinfra would print them all once more.
        return status, (output if status else CommandOutput([]))


def ticking(command: str, tick: str) -> str:
    """Shell that runs `command` in the background and, while it runs, the shell `tick` every
    PROGRESS_EVERY_S seconds (with $elapsed, the seconds since it started); its status is the
    command's, so `ticking(...) || ...` handles a failure."""
    every_s = PROGRESS_EVERY_S
    return (
        f"{command} & job=$!; started=$(date +%s); next={every_s}; "
        "while kill -0 $job 2>/dev/null; do sleep 1; elapsed=$(($(date +%s) - started)); "
        f"if [ $elapsed -ge $next ] && kill -0 $job 2>/dev/null; then {tick}; next=$((elapsed + {every_s})); fi; "
        "done; wait $job"
    )


def printf_line(text: str, *arguments: str) -> str:
    """A shell printf of `text` (a format: %d, %s) and a newline, with its shell `arguments`."""
    return " ".join(["printf", shlex.quote(text + "\\n"), *arguments])


def seconds(value: float) -> str:
    """``95 s``, ``12 min``: a duration the way a progress line says it."""
    return f"{value:.0f} s" if value < 600 else f"{value / 60:.0f} min"


def start_format(engine: str, cold: bool, cold_start_s: float | None, budget_s: int) -> str:
    """The printf format (%d: seconds since the start) of an engine start's progress line.

    + engine: the engine's name (a schema-checked name, no % in it)
    + cold: this start rebuilds the engine's JIT caches
    + cold_start_s: its last cold start, from the host record or the inventory (None: never measured)
    + budget_s: the readiness helper's budget, after which the start fails
    """
    if cold_start_s is None:
        return f"{engine}: %d s (no cold start recorded yet; the start fails after {seconds(budget_s)})"
    if cold:
        return f"{engine}: %d s of ~{seconds(cold_start_s)} (its recorded cold start)"
    return f"{engine}: %d s (caches warm; its recorded cold start took ~{seconds(cold_start_s)})"
