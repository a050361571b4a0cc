"""The exit codes of every `sparkform` command, in one table: `sparkform --help` prints it and
docs/operator.md holds it (tests/unit/test_readme.py keeps the two equal)."""

from __future__ import annotations

OK, FAILED, USAGE, UNTRUSTED_OR_NO_ANSWER, HOST_LOCKED, INTERRUPTED = 0, 1, 2, 3, 4, 130

EXIT_CODES = (
    (
        OK,
        "success: what the command does is done, what it checks holds (status: every engine serves through "
        "its front and the guard runs; verify, contract: every check passed). A reader that left early "
        "(`| head`) counts as success too.",
    ),
    (
        FAILED,
        "what it checks does not hold (status, verify, contract, bench), or a host did not answer over SSH "
        "(named in one line, with ssh's reason), or a deploy it ran failed",
    ),
    (
        USAGE,
        "nothing was asked of a host: an inventory that cannot be loaded or is invalid (one line per "
        "problem: file or host, field, value, fix), or an option that names nothing",
    ),
    (
        UNTRUSTED_OR_NO_ANSWER,
        "the deploy: the host holds a value sparkform never writes (nothing changed); contract: a host or "
        "engine did not answer, so its contract was not checked",
    ),
    (HOST_LOCKED, "deploy, rebuild, rollback: another run held the host longer than host_lock_wait_s"),
    (INTERRUPTED, "interrupted (Ctrl-C): no traceback, the host as the command left it"),
)


def exit_code_table() -> str:
    """The table, Markdown (docs/operator.md) and as `--help` shows it."""
    return "\n".join(["| exit | meaning |", "|---|---|", *(f"| {code} | {meaning} |" for code, meaning in EXIT_CODES)])
