"""`sparkform`: plan, render and verify an inventory's hosts, and run the local sandbox.

`plan`, `render` and `fields` never connect; `verify` validates the inventory before it does.
Exit codes: 0 success; 2 the inventory is invalid (each problem printed with host, engine,
field, value and fix); 1 any other error (e.g. the inventory file is missing).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from sparkform import planner
from sparkform.inventory import exit_invalid, load_inventory
from sparkform.render import render_host
from sparkform.schema import Checkpoint, CompileCaps, Engine, HostConfig, Measured
from sparkform.validate import InventoryError


def _cmd_plan(args: argparse.Namespace) -> int:
    hosts = load_inventory(args.inventory)
    plans = [planner.plan(host) for host in hosts]
    if args.json:
        print(json.dumps([p.as_dict() for p in plans], indent=2))
    else:
        print("\n\n".join(planner.format_plan(p) for p in plans))
    return 0


def _cmd_render(args: argparse.Namespace) -> int:
    for host in load_inventory(args.inventory):
        if args.host and host.name != args.host:
            continue
        root = args.out / host.name
        for file in render_host(host.config):
            target = root / file.path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(file.content)
            target.chmod(int(file.mode, 8))
            print(target)
    return 0


VERIFY_SUITE = Path(__file__).resolve().parent.parent / "tests" / "verify"


def _cmd_verify(args: argparse.Namespace) -> int:
    """Run the testinfra suite against every host of the inventory (exit code: pytest's)."""
    load_inventory(args.inventory)  # a broken inventory stops here, before any connection
    import pytest

    options = [str(VERIFY_SUITE), f"--inventory={args.inventory.resolve()}", "-p", "no:cacheprovider",
               f"--rootdir={VERIFY_SUITE}", "-q", *(["--deep"] if args.deep else []), *args.pytest_args]
    return int(pytest.main(options))


SANDBOX_INVENTORY = Path(__file__).resolve().parent.parent / "inventory" / "sandbox.py"


def _sandbox_howto(box) -> str:
    """How to reach a sandbox and its engines from this machine."""
    from sparkform.sandbox import stage

    key = stage.secret_file(box.runtime_dir, "api_key")
    lines = [f"ssh in:  sparkform sandbox ssh --name {box.name}   (or: ssh -F {box.ssh_config} {box.host_alias})"]
    os.environ["SPARKFORM_SANDBOX"] = box.name  # the inventory points at this sandbox
    for target in load_inventory(SANDBOX_INVENTORY):
        for engine in target.config.enabled_engines:
            body = json.dumps({"model": engine.names[0], "max_tokens": 8,
                               "messages": [{"role": "user", "content": "hello"}]})
            lines.append(f"{engine.name}: curl -s -H \"Authorization: Bearer $(cat {key})\" "
                         f"-H 'Content-Type: application/json' -d '{body}' "
                         f"http://{box.address}:{engine.port}/v1/chat/completions")
    return "\n".join(lines)


def _cmd_sandbox(args: argparse.Namespace) -> int:
    """Local rehearsal host (Linux, root): up, down, status, or an SSH session."""
    from sparkform.sandbox import host, stage

    try:
        if args.action == "up":
            box = stage.up(args.name)
            print(f"ssh: ssh -F {box.ssh_config} {box.host_alias}")
        elif args.action == "down":
            stage.down(args.name)
        elif args.action == "status":
            state = host.status(args.name)
            print(json.dumps(state, indent=2, default=str))
            if state["up"]:
                print(_sandbox_howto(host.get(args.name)))
        else:
            box = host.get(args.name)
            return subprocess.call([*box.ssh_args(), *args.command])
    except host.SandboxError as err:
        print(f"sparkform sandbox {args.action}: {err}", file=sys.stderr)
        return 1
    return 0


def field_table() -> str:
    """The README's table of inventory fields, from the schema's own descriptions."""
    sections = [("host", HostConfig), ("compile_caps.", CompileCaps), ("engines[].", Engine),
                ("engines[].checkpoint.", Checkpoint), ("engines[].measured.", Measured)]
    lines = ["| field | default | meaning |", "|---|---|---|"]
    for prefix, model in sections:
        for name, info in model.model_fields.items():
            if info.is_required():
                default = "required"
            else:
                value = info.get_default(call_default_factory=True)
                default = "—" if isinstance(value, (CompileCaps, Measured)) else f"`{json.dumps(value)}`"
            label = name if prefix == "host" else f"{prefix}{name}"
            lines.append(f"| `{label}` | {default} | {info.description} |")
    return "\n".join(lines)


def _cmd_fields(_: argparse.Namespace) -> int:
    print(field_table())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparkform", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="validate an inventory and print each host's memory plan")
    plan.add_argument("inventory", type=Path)
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    plan.set_defaults(run=_cmd_plan)
    render = sub.add_parser("render", help="write every file a deploy would put on the hosts into a folder")
    render.add_argument("inventory", type=Path)
    render.add_argument("--out", type=Path, required=True)
    render.add_argument("--host", help="only this host")
    render.set_defaults(run=_cmd_render)
    verify = sub.add_parser("verify", help="check converged hosts over SSH (testinfra suite tests/verify)")
    verify.add_argument("inventory", type=Path)
    verify.add_argument("--deep", action="store_true", help="also re-hash every checkpoint file against its manifest")
    verify.add_argument("pytest_args", nargs="*", help="further pytest arguments (after --)")
    verify.set_defaults(run=_cmd_verify)
    sandbox = sub.add_parser("sandbox", help="a local real-systemd host running real vLLM (root)")
    sandbox.add_argument("action", choices=["up", "down", "status", "ssh"])
    sandbox.add_argument("command", nargs="*", help="for ssh: a command to run instead of a shell")
    sandbox.add_argument("--name", default=os.environ.get("SPARKFORM_SANDBOX", "sandbox"),
                         help="sandbox name (default: $SPARKFORM_SANDBOX or 'sandbox')")
    sandbox.set_defaults(run=_cmd_sandbox)
    fields = sub.add_parser("fields", help="print the inventory field table (Markdown)")
    fields.set_defaults(run=_cmd_fields)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except InventoryError as err:
        exit_invalid(err, str(args.inventory))
    except (FileNotFoundError, IsADirectoryError) as err:
        print(f"sparkform: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
