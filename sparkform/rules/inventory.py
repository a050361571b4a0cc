"""Reading pyinfra inventories without connecting to anything.

An inventory module builds its host list with `hosts()`, which validates every host when the
module is imported: pyinfra imports the inventory before it opens any connection, so a broken
inventory stops `pyinfra inventory/x.py deploy.py` before anything on a host changes.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from pydantic import ValidationError

from sparkform.domain import modelconfig
from sparkform.domain.model import Host, InventoryError, Problem
from sparkform.domain.schema import HostConfig
from sparkform.domain.shapes import owned_flag
from sparkform.rules.nodes import span_problems
from sparkform.rules.validate import host_problems

BASE_DIR_KEY = "_sparkform_base_dir"  # relative paths in host data resolve against it
# The inventory a command reads when none is named (where `sparkform init` writes one), unless
# SPARKFORM_INVENTORY names another.
DEFAULT_INVENTORY = "~/.config/sparkform/inventory.py"
INVENTORY_HELP = f"the pyinfra inventory file (default: $SPARKFORM_INVENTORY, else {DEFAULT_INVENTORY})"
EXIT_INVALID = 2
EXIT_UNTRUSTED = 3  # the host holds a value sparkform never writes (sparkform.deploy.facts.snapshot.HostSnapshot)


def _pydantic_problems(host: str, data: dict[str, Any], err: ValidationError) -> list[Problem]:
    problems = []
    listed = data.get("engines")
    engines = listed if isinstance(listed, list) else []
    for error in err.errors():
        loc = list(error["loc"])
        engine = None
        if len(loc) >= 2 and loc[0] == "engines" and isinstance(loc[1], int):
            index = loc[1]
            raw = engines[index] if index < len(engines) else None
            engine = raw.get("name", f"#{index}") if isinstance(raw, dict) else f"#{index}"
            loc = loc[2:]
        path = ".".join(str(part) for part in loc) or "engines"
        kind = error["type"]
        if kind == "extra_forbidden":
            fix = "remove it or correct its spelling (every field is in docs/fields.md)"
            message = "unknown key"
        elif kind == "missing":
            fix = "set it (every field is in docs/fields.md)"
            message = "required field is missing"
        else:
            message = error["msg"].removeprefix("Value error, ")
            fix = "give a value of the documented type and range (docs/fields.md)"
        value = _redact_api_key(error.get("input")) if path == "extra_args" else error.get("input")
        problems.append(Problem(host, path, value, message, fix, engine))
    return problems


def _redact_api_key(args: Any) -> Any:
    """extra_args refused for an `--api-key`: print them without the key (CI logs, terminals)."""
    if not isinstance(args, list):
        return args
    redacted, hide_next = [], False
    for arg in args:
        if hide_next:
            redacted.append("***")
            hide_next = False
        elif isinstance(arg, str) and owned_flag(arg) == "--api-key":
            hide_next = "=" not in arg
            redacted.append(arg if hide_next else f"{arg.split('=', 1)[0]}=***")
        else:
            redacted.append(arg)
    return redacted


def _model_configs(host: str, config: HostConfig, base_dir: Path) -> tuple[dict, list[Problem]]:
    configs, problems = {}, []
    for engine in config.engines:
        if not engine.model_config_path:
            continue
        path = (base_dir / engine.model_config_path).resolve()
        try:
            configs[engine.name] = modelconfig.load(path)
            modelconfig.geometry(configs[engine.name])
        except modelconfig.ModelConfigError as err:
            configs.pop(engine.name, None)
            problems.append(
                Problem(
                    host,
                    "model_config_path",
                    engine.model_config_path,
                    str(err),
                    "point it at the checkpoint's config.json",
                    engine.name,
                )
            )
    return configs, problems


# Files on the control machine; relative paths resolve against the inventory's folder.
LOCAL_PATH_FIELDS = ("hf_token_file", "api_key_file", "alert_webhook_file", "wheelhouse_source", "lock_file")


# While `planning()` holds: a file only a deploy reads may be missing (a plan lists it instead).
_planning = False


@contextlib.contextmanager
def planning():
    """Load inventories for a plan meanwhile: the problems a deploy alone would meet (a secret
    or host key file that is not there yet) go into each Host's `needs` instead of failing."""
    global _planning
    before, _planning = _planning, True
    try:
        yield
    finally:
        _planning = before


def load_host(name: str, data: dict[str, Any], base_dir: Path = Path(".")) -> Host:
    """Validate one host's data; raise InventoryError with every problem found.

    Relative local paths (secret files, api_keys' files, front_tls' files, the wheelhouse source, the locks (the
    host's and engines'), model configs) resolve against `base_dir`, the inventory's folder, whatever the current
    directory is.
    """
    data = {
        **data,
        **{
            key: str((base_dir / Path(data[key]).expanduser()).resolve())
            for key in LOCAL_PATH_FIELDS
            if isinstance(data.get(key), str)
        },
    }
    if isinstance(data.get("front_tls"), dict):
        data["front_tls"] = {
            **data["front_tls"],
            **{
                key: str((base_dir / Path(path).expanduser()).resolve())
                for key in ("cert_file", "key_file")
                if isinstance(path := data["front_tls"].get(key), str)
            },
        }
    if isinstance(data.get("engines"), list):
        data["engines"] = [
            {**engine, "lock_file": str((base_dir / Path(engine["lock_file"]).expanduser()).resolve())}
            if isinstance(engine, dict) and isinstance(engine.get("lock_file"), str)
            else engine
            for engine in data["engines"]
        ]
    if isinstance(data.get("api_keys"), dict):
        data["api_keys"] = {
            name: str((base_dir / Path(path).expanduser()).resolve()) if isinstance(path, str) else path
            for name, path in data["api_keys"].items()
        }
    try:
        config = HostConfig.model_validate(data).named(name)
    except ValidationError as err:
        raise InventoryError(_pydantic_problems(name, data, err) + _host_key_problems(name, data, base_dir)) from None
    model_configs, problems = _model_configs(name, config, base_dir)
    problems += _host_key_problems(name, data, base_dir)
    host = Host(name, config, model_configs)
    problems += host_problems(host)
    if _planning:
        host.needs = [p for p in problems if p.deploy_only]
        problems = [p for p in problems if not p.deploy_only]
    if problems:
        raise InventoryError(problems)
    return host


def _host_key_problems(name: str, data: dict[str, Any], base_dir: Path) -> list[Problem]:
    """Strict host key checking with a known_hosts file that is not there refuses every
    connection, late and with a paramiko error: say so now, with how to record the key."""
    known_hosts = data.get("ssh_known_hosts_file")
    if data.get("ssh_strict_host_key_checking") != "yes" or not isinstance(known_hosts, str):
        return []
    if (base_dir / Path(known_hosts).expanduser()).is_file():
        return []
    return [
        Problem(
            name,
            "ssh_known_hosts_file",
            known_hosts,
            "no such file, and strict host key checking trusts no key it does not hold",
            f'record the host\'s key once (docs/security.md, "Pinned host keys"): ssh-keyscan -t ed25519 '
            f"{data.get('ssh_hostname', name)} >> {known_hosts}, after comparing its fingerprint with "
            "the one the host's console shows",
            deploy_only=True,
        )
    ]


def exit_invalid(err: InventoryError, source: str) -> NoReturn:
    """Print every problem and exit 2. SystemExit passes through pyinfra's loader, so a
    `pyinfra` run stops with these lines instead of a traceback, before connecting."""
    print(f"sparkform: invalid inventory {source}:", file=sys.stderr)
    for problem in err.problems:
        print(f"  - {problem}", file=sys.stderr)
    raise SystemExit(EXIT_INVALID)


def exit_untrusted(host: str, findings: list[str]) -> NoReturn:
    """Print what the host holds that sparkform never wrote, and exit 3: root acts on none of it."""
    print(f"sparkform: {host} holds values sparkform never writes; nothing was changed:", file=sys.stderr)
    for finding in findings:
        print(f"  - {host}: {finding}", file=sys.stderr)
    print(
        "  Fix: find out what wrote them (an engine user, a hand edit), remove those files, and run the deploy again.",
        file=sys.stderr,
    )
    raise SystemExit(EXIT_UNTRUSTED)


def hosts(data_by_host: dict[str, dict[str, Any]], inventory_file: str) -> list[tuple[str, dict[str, Any]]]:
    """The pyinfra host list for `data_by_host`, validated: exits 2 listing every problem."""
    base_dir = Path(inventory_file).resolve().parent
    try:
        _load_all(data_by_host, lambda name, data: load_host(name, data, base_dir))
    except InventoryError as err:
        exit_invalid(err, inventory_file)
    return [(name, {**data, BASE_DIR_KEY: str(base_dir)}) for name, data in data_by_host.items()]


def host_from_data(name: str, data: dict[str, Any]) -> Host:
    """Validate a host's data as pyinfra holds it (after --data and group data are merged)."""
    return load_host(name, data, Path(data.get(BASE_DIR_KEY, ".")))


def default_inventory() -> Path:
    """The inventory a command reads when none is named: $SPARKFORM_INVENTORY, else DEFAULT_INVENTORY."""
    return Path(os.environ.get("SPARKFORM_INVENTORY") or DEFAULT_INVENTORY).expanduser()


class UnloadableInventory(Exception):
    """An inventory file that cannot be read as a pyinfra inventory module: one line says which
    file, what is wrong and the fix."""


def _run_inventory(path: Path) -> dict[str, Any]:
    """The inventory module's names once it ran; UnloadableInventory when it cannot run."""
    if not path.exists():
        raise UnloadableInventory(
            f"{path}: no such file (name an inventory, e.g. inventory/spark.py, set SPARKFORM_INVENTORY, or write "
            f"one with `sparkform init`, which makes {DEFAULT_INVENTORY})"
        )
    if path.is_dir():
        raise UnloadableInventory(f"{path} is a folder: give the inventory file in it, e.g. {path / 'spark.py'}")
    if path.suffix != ".py":
        raise UnloadableInventory(
            f"{path} is not a Python file: an inventory is a pyinfra inventory module (.py), as "
            "inventory/spark.py is; `sparkform init` writes one"
        )
    try:
        return runpy.run_path(str(path))
    except SyntaxError as err:
        raise UnloadableInventory(
            f"{path}, line {err.lineno}: {err.msg}: fix that line (python3 -m py_compile {path} shows it)"
        ) from None
    except Exception as err:  # the module's own code raised: name the line of the file that did
        lines = [frame.lineno for frame in traceback.extract_tb(err.__traceback__) if frame.filename == str(path)]
        where = f", line {lines[-1]}" if lines else ""
        raise UnloadableInventory(
            f"{path}{where} raised {type(err).__name__}: {err}: fix the inventory (python3 {path} shows the traceback)"
        ) from None


def raw_inventory(path: Path) -> dict[str, dict[str, Any]]:
    """Each host's data as the pyinfra inventory module defines it (connector keys included)."""
    namespace = _run_inventory(Path(path))
    found: dict[str, dict[str, Any]] = {}
    for name, value in namespace.items():
        if name.startswith("_") or not isinstance(value, (list, tuple)):
            continue
        for entry in value:
            if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], dict):
                found[entry[0]] = {BASE_DIR_KEY: str(Path(path).resolve().parent), **entry[1]}
            elif isinstance(entry, str):
                found[entry] = {BASE_DIR_KEY: str(Path(path).resolve().parent)}
    return found


def load_inventory(path: Path) -> list[Host]:
    """Every host of a pyinfra inventory module, validated."""
    found = raw_inventory(path)
    if not found:
        raise InventoryError(
            [
                Problem(
                    str(path),
                    "hosts",
                    None,
                    "the inventory defines no host",
                    "define a list of (name, data) tuples, e.g. with sparkform.rules.inventory.hosts()",
                )
            ]
        )
    return _load_all(found, host_from_data)


def _load_all(data_by_host: dict[str, dict[str, Any]], load: Callable[[str, dict[str, Any]], Host]) -> list[Host]:
    """Every host loaded by `load`, then the engines that span hosts checked across them; raise
    InventoryError with every problem of every host."""
    loaded, problems = [], []
    for name, data in data_by_host.items():
        try:
            loaded.append(load(name, data))
        except InventoryError as err:
            problems += err.problems
    problems += span_problems(loaded, data_by_host)
    if problems:
        raise InventoryError(problems)
    return loaded
