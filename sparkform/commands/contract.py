"""`sparkform contract INVENTORY [--host H] [--engine E] [--json]`: hold each live engine to the
request contract of the vLLM version it serves (sparkform/reports/contract.py).

Every request runs as curl on the host over SSH, as the verify suite's do: the OpenAI routes
through the front with the API key (read on the host from the front's root-only snippet and
handed to curl on a pipe, never in an argv or a log), /tokenize and /version on the engine's
own socket (the front passes neither). Request bodies go to curl on stdin.

Exit codes: 0 every check passed (or was skipped, with its reason); 1 a check failed; 2 the
inventory is invalid, or --host/--engine names none of it; 3 a host or an engine did not answer
(one line each: host, engine, what was asked, why), so its contract was not checked.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from sparkform.commands import ssh
from sparkform.commands.status import positive_seconds
from sparkform.domain.engine import Engine
from sparkform.domain.layout import engine_curl
from sparkform.domain.schema import HostConfig
from sparkform.reports.contract import Finding, NoAnswer, Reply, Request, contract_table, major_minor
from sparkform.reports.contract_requests import check_engine
from sparkform.rules.inventory import INVENTORY_HELP, load_inventory, raw_inventory

EXIT_FAILED, EXIT_NO_ANSWER = 1, 3
REQUEST_TIMEOUT_S = 300.0
STATUS_MARK = "@@sparkform-http:"
# Every client's key as the front's snippet holds it (sparkform.host.front_keys.clients_snippet),
# its . and + unescaped:     "~^Bearer KEY$" "NAME";     and the first one only.
KEYS_FROM_SNIPPET = r'/^    "~^Bearer /{s/^    "~^Bearer \([^"]*\)[$]" .*/\1/;s/\\//g;p;}'
KEY_FROM_SNIPPET = KEYS_FROM_SNIPPET.replace("p;}", "p;q;}")
# curl's exit codes a client meets when the engine does not answer (man curl).
CURL_FAILURES = {
    6: "could not resolve the address",
    7: "connection refused",
    28: "no answer within the timeout",
    52: "empty reply (the engine closed the connection)",
    56: "the connection broke while receiving",
}


def key_header(snippet: str) -> str:
    """curl arguments that send `Authorization: Bearer <key>`, the key read from the front's
    snippet on the host by a bash builtin and handed to curl through a pipe (never in argv)."""
    return (
        f"--config <(printf 'header = \"Authorization: Bearer %s\"\\n' "
        f'"$(sed -n {shlex.quote(KEY_FROM_SNIPPET)} {shlex.quote(snippet)} 2>/dev/null)")'
    )


def target(config: HostConfig, engine: Engine, request: Request) -> str:
    """curl's arguments for where the request goes from the host: the front, or the engine's own
    socket."""
    if request.front:
        return shlex.quote(config.front_url(engine.port, request.path))
    return engine_curl(config.engine_socket(engine), request.path)


def curl_script(config: HostConfig, engine: Engine, request: Request, timeout_s: float) -> str:
    """The bash script that sends `request` from the host; it prints the body, then the status
    after STATUS_MARK, and exits with curl's code. A body comes on stdin."""
    words = [
        "curl -sS",
        f"--max-time {timeout_s:.0f}",
        "-w " + shlex.quote(f"\n{STATUS_MARK}%{{http_code}}"),
        key_header(config.paths.front_key) if request.front and config.front_keyed else "",
        config.front_curl_tls if request.front else "",
        "-H 'Content-Type: application/json' --data-binary @-" if request.body is not None else "",
        target(config, engine, request),
    ]
    return " ".join(word for word in words if word)


def parse_curl(output: str) -> Reply | None:
    """The reply curl_script printed; None when no status came back."""
    body, mark, status = output.rpartition(f"\n{STATUS_MARK}")
    if not mark or not status.strip().isdigit() or status.strip() == "000":
        return None
    return Reply(int(status.strip()), body)


class HostAsker:
    """Sends requests to one engine by curl on its host: `on_host` + [a shell command] runs the
    command there (ssh_asker: over SSH, one master connection)."""

    def __init__(self, on_host: list[str], config: HostConfig, engine: Engine, timeout_s: float):
        self.on_host, self.config, self.engine, self.timeout_s = on_host, config, engine, timeout_s

    def __call__(self, request: Request) -> Reply:
        script = curl_script(self.config, self.engine, request, self.timeout_s)
        try:
            result = subprocess.run(
                [*self.on_host, f"bash -c {shlex.quote(script)}"],
                input=json.dumps(request.body) if request.body is not None else "",
                capture_output=True,
                text=True,
                timeout=self.timeout_s + 30,
            )
        except subprocess.TimeoutExpired:
            raise NoAnswer(f"{request.path}: no answer within {self.timeout_s + 30:.0f} s") from None
        reply = parse_curl(result.stdout)
        if reply is not None:
            return reply
        if result.returncode == 255:
            raise NoAnswer(f"{request.path}: the host does not answer over SSH ({ssh.failure(result)})")
        why = CURL_FAILURES.get(result.returncode, f"curl exit {result.returncode}")
        where = (
            f"the front ({self.config.front_url(self.engine.port, request.path)})"
            if request.front
            else f"the engine's own socket ({self.config.engine_socket(self.engine)})"
        )
        raise NoAnswer(f"{request.path} on {where}: {why}")


def ssh_asker(ssh_config: Path, host: str, config: HostConfig, engine: Engine, timeout_s: float) -> HostAsker:
    return HostAsker(["ssh", "-F", str(ssh_config), ssh.alias(host)], config, engine, timeout_s)


def live_version(ask: HostAsker) -> str:
    """The vLLM version the engine serves (/version on its own socket), checked before use."""
    reply = ask(Request("/version", front=False))
    body = reply.json() if reply.status == 200 else None
    version = body.get("version") if isinstance(body, dict) else None
    if not isinstance(version, str) or major_minor(version) is None:
        raise NoAnswer(f"/version answered HTTP {reply.status} without a vLLM version")
    return version


def format_findings(rows: list[dict[str, Any]]) -> str:
    header = ("host", "engine", "check", "result", "detail")
    table = [header] + [tuple(str(row[key]) for key in header) for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(header) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=False)) + "  " + line[-1] for line in table
    )


def run(args: argparse.Namespace) -> int:
    if args.table:
        print(contract_table())
        return 0
    hosts = [h for h in load_inventory(args.inventory) if args.host in (None, h.name)]
    targets = [(h, e) for h in hosts for e in h.config.served_engines if args.engine in (None, e.name)]
    if not targets:
        wanted = " ".join(
            f"{flag} {value!r}" for flag, value in (("--host", args.host), ("--engine", args.engine)) if value
        )
        print(f"sparkform contract: {args.inventory} has no enabled engine for {wanted}", file=sys.stderr)
        return 2
    raw = raw_inventory(args.inventory)
    rows: list[dict[str, Any]] = []
    silent: list[str] = []
    with tempfile.TemporaryDirectory(prefix="sparkform-contract-") as folder:
        for host, engine in targets:
            ssh_config = ssh.write_config(host.name, raw[host.name], Path(folder))
            ask = ssh_asker(ssh_config, host.name, host.config, engine, args.timeout)
            try:
                findings = check_engine(ask, host.config, engine, live_version(ask))
            except NoAnswer as err:
                silent.append(f"sparkform contract: {host.name} {engine.name}: {err}; its contract was not checked")
                continue
            rows += [_row(host.name, engine.name, finding) for finding in findings]
    if args.json:
        print(json.dumps(rows, indent=2))
    elif rows:
        print(format_findings(rows))
    for line in silent:
        print(line, file=sys.stderr)
    if silent:
        return EXIT_NO_ANSWER
    return EXIT_FAILED if any(row["result"] == "fail" for row in rows) else 0


def _row(host: str, engine: str, finding: Finding) -> dict[str, Any]:
    return {
        "host": host,
        "engine": engine,
        "check": finding.check,
        "result": finding.result,
        "detail": finding.detail,
        "observed": finding.observed,
    }


def add_parser(sub: argparse._SubParsersAction) -> None:
    contract = sub.add_parser(
        "contract", help="check each live engine against the request contract of its vLLM version (docs/operator.md)"
    )
    contract.add_argument("inventory", type=Path, nargs="?", help=INVENTORY_HELP)
    contract.add_argument("--host", help="only this host")
    contract.add_argument("--engine", help="only this engine")
    contract.add_argument("--json", action="store_true", help="one JSON list of every check, with what was observed")
    contract.add_argument(
        "--timeout",
        type=positive_seconds,
        default=REQUEST_TIMEOUT_S,
        help=f"seconds each request may take (default {REQUEST_TIMEOUT_S:.0f}; the over-window one fills the window)",
    )
    contract.add_argument("--table", action="store_true", help="print the contract table per vLLM version and exit")
    contract.set_defaults(run=run)
