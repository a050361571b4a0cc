"""`sparkform sandbox ...`: the command line of the local rehearsal machines."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from sparkform.domain.package_data import INVENTORIES
from sparkform.rules.inventory import load_inventory
from sparkform.sandbox.network import CABLE_INTERFACE, CABLE_MTU

SANDBOX_INVENTORY = INVENTORIES / "sandbox.py"
# pyproject's `sandbox` extra: the stage's fake hub builds its tiny checkpoints with them.
SANDBOX_EXTRA = ("numpy", "tokenizers", "safetensors")


def _howto(box) -> str:
    """How to reach a sandbox and its engines from this machine (a bare one: only SSH)."""
    from sparkform.sandbox import stage

    key = stage.secret_file(box.runtime_dir, "api_key")
    # This sparkform's own path: `make sandbox` runs it from a venv it does not activate.
    beside = Path(sys.executable).with_name("sparkform")
    sparkform = shlex.quote(str(beside)) if beside.exists() else "sparkform"
    lines = [f"ssh in:  {sparkform} sandbox ssh --name {box.name}   (or: ssh -F {box.ssh_config} {box.host_alias})"]
    if not key.exists():  # up --bare: no secrets, so the sandbox inventory does not load
        return "\n".join(lines)
    os.environ["SPARKFORM_SANDBOX"] = box.name  # the inventory points at this sandbox
    for target in load_inventory(SANDBOX_INVENTORY):
        for engine in target.config.served_engines:
            # A chat for a generator; a pooling engine's own request (an embedding, a rerank).
            route, request = (
                (engine.probe["route"], engine.probe["body"])
                if engine.pooling
                else (
                    "/v1/chat/completions",
                    {"model": engine.names[0], "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]},
                )
            )
            lines.append(
                f'{engine.name}: curl -s -H "Authorization: Bearer $(cat {key})" '
                f"-H 'Content-Type: application/json' -d '{json.dumps(request)}' "
                f"http://{box.address}:{engine.port}{route}"
            )
        if target.config.front_port:
            lines.append(
                f'every model, one port: curl -s -H "Authorization: Bearer $(cat {key})" '
                f"http://{box.address}:{target.config.front_port}/v1/models   (docs/clients.md)"
            )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Local rehearsal machines (Linux, root): build the caches, up, link two, down, status, names,
    reboot, memory, or an SSH session. `--bare` works on a machine without the stage (hub, alert receiver,
    secrets, wheelhouse, nvidia-smi), on the rootfs with the base packages only."""
    missing = [name for name in SANDBOX_EXTRA if importlib.util.find_spec(name) is None]
    if missing and args.action in ("build", "up") and not args.bare:
        print(f"sparkform sandbox: {', '.join(missing)} missing: pip install 'sparkform[sandbox]'", file=sys.stderr)
        return 1
    from sparkform.sandbox import machine, network, registry, rootfs, stage
    from sparkform.sandbox.system import SandboxError

    try:
        if args.action == "build":
            built = [rootfs.build_rootfs()] if args.bare else stage.build()
            print("\n".join(str(path) for path in built))
        elif args.action == "up":
            if args.keep and machine.status(args.name)["up"]:
                box = machine.get(args.name)
                print(f"{args.name} is already up: kept as it is")
            else:
                box = machine.up(args.name, args.bind_ro) if args.bare else stage.up(args.name, args.bind_ro)
            print(f"ssh: ssh -F {box.ssh_config} {box.host_alias}")
        elif args.action == "link":
            print(machine.link(args.name, args.peer))
        elif args.action == "down":
            stage.down(args.name)
        elif args.action == "status":
            state = machine.status(args.name)
            if args.json:
                print(json.dumps(state, indent=2, default=str))
            elif state["up"]:
                print(f"{args.name}: up at {state['address']} (systemd: {state['state'] or 'unreachable'})")
                if state["cable"]:
                    print(f"cable:   {network.Cable(**state['cable'])}")
                print(_howto(machine.get(args.name)))
            else:
                print(f"{args.name}: not up")
        elif args.action == "names":
            print("\n".join(registry.names()))
        elif args.action == "reboot":
            machine.reboot(args.name)
        elif args.action == "memory":
            machine.memory_controller_writable(args.name)
        else:
            box = machine.get(args.name)
            return subprocess.call([*box.ssh_args(), *args.remote_command])
    except SandboxError as err:
        print(f"sparkform sandbox {args.action}: {err}", file=sys.stderr)
        return 1
    return 0


def _bind(text: str) -> tuple[str, str]:
    """HOST:GUEST of --bind-ro as a (host path, guest path) pair."""
    host_path, colon, guest_path = text.partition(":")
    if not colon:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:GUEST")
    return host_path, guest_path


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`sparkform sandbox [--name N] ACTION [--name N] ...`."""
    sandbox = sub.add_parser(
        "sandbox", help="a local real-systemd machine running real vLLM (root)", description=run.__doc__
    )
    name_help = "sandbox name (default: $SPARKFORM_SANDBOX or 'sandbox')"
    sandbox.add_argument("--name", default=os.environ.get("SPARKFORM_SANDBOX", "sandbox"), help=name_help)
    sandbox.set_defaults(run=run)
    actions = sandbox.add_subparsers(dest="action", required=True, metavar="ACTION")

    def action(verb: str, help: str, named: bool = True) -> argparse.ArgumentParser:
        parser = actions.add_parser(verb, help=help, description=help)
        if named:  # SUPPRESS: a --name after ACTION wins; else the one before it (or the default) stays
            parser.add_argument("--name", default=argparse.SUPPRESS, help=name_help)
        return parser

    build = action("build", "build the cached rootfs and wheelhouse that `up` boots (prints their paths)", named=False)
    build.add_argument("--bare", action="store_true", help="only the rootfs of a bare machine")
    up = action("up", "boot a machine and stage it for a deploy; prints how to ssh in")
    up.add_argument(
        "--bare",
        action="store_true",
        help="a bare machine: base packages only; no hub, alert receiver, secrets, wheelhouse or nvidia-smi",
    )
    up.add_argument(
        "--keep", action="store_true", help="a machine of that name that is up stays as it is (no error, no reboot)"
    )
    up.add_argument(
        "--bind-ro",
        type=_bind,
        action="append",
        default=[],
        metavar="HOST:GUEST",
        help="also bind this folder of this machine read-only into the guest (repeatable)",
    )
    link = action(
        "link",
        f"lay the pair's direct cable (the Sparks' ConnectX-7 link) to another machine that is up: interface "
        f"{CABLE_INTERFACE} in both, MTU {CABLE_MTU}, this one 10.234.K.1/30, the peer .2 (linked already: nothing)",
    )
    link.add_argument("peer", help="the other sandbox's name")
    action("down", "power the machine off and remove every trace of it (a name that is not up: nothing)")
    status = action("status", "whether the machine runs, its address and systemd's state; how to reach its engines")
    status.add_argument("--json", action="store_true", help="only the state, as one JSON object")
    action("names", "the sandboxes that are up (or died without `down`)", named=False)
    action("reboot", "reboot the guest and wait until every enabled unit started again")
    action("memory", "make the guest enforce MemoryMax= (`up` does this unless --bare)")
    ssh = action("ssh", "an SSH session in the guest, or one command (after --)")
    ssh.add_argument("remote_command", nargs="*", metavar="command", help="a command to run instead of a shell")
