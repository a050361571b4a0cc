"""Reading pyinfra inventories without connecting to anything.

An inventory module builds its host list with `hosts()`, which validates every host when the
module is imported: pyinfra imports the inventory before it opens any connection, so a broken
inventory stops `pyinfra inventory/x.py deploy.py` before anything on a host changes.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Any, NoReturn

from sparkform.model import Host, InventoryError, Problem
from sparkform.validate import load_host

BASE_DIR_KEY = "_sparkform_base_dir"  # relative paths in host data resolve against it
EXIT_INVALID = 2
EXIT_UNTRUSTED = 3  # the host holds a value sparkform never writes (facts.snapshot.HostSnapshot)


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
    problems = []
    for name, data in data_by_host.items():
        try:
            load_host(name, data, base_dir)
        except InventoryError as err:
            problems += err.problems
    if problems:
        exit_invalid(InventoryError(problems), inventory_file)
    return [(name, {**data, BASE_DIR_KEY: str(base_dir)}) for name, data in data_by_host.items()]


def host_from_data(name: str, data: dict[str, Any]) -> Host:
    """Validate a host's data as pyinfra holds it (after --data and group data are merged)."""
    return load_host(name, data, Path(data.get(BASE_DIR_KEY, ".")))


def raw_inventory(path: Path) -> dict[str, dict[str, Any]]:
    """Each host's data as the pyinfra inventory module defines it (connector keys included)."""
    namespace = runpy.run_path(str(path))
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
                    "define a list of (name, data) tuples, e.g. with sparkform.inventory.hosts()",
                )
            ]
        )
    loaded, problems = [], []
    for name, data in found.items():
        try:
            loaded.append(host_from_data(name, data))
        except InventoryError as err:
            problems += err.problems
    if problems:
        raise InventoryError(problems)
    return loaded
