"""The project's modules import each other without a cycle, at module level or inside a function,
and each room of the package imports only the rooms below it: the core builds upward from the
spec, and the commands, the deploy and the sandbox on the core."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def project_modules() -> dict[str, Path]:
    """Every module of the project by dotted name, deploy.py included."""
    modules = {"deploy": REPO / "deploy.py"}
    for path in (REPO / "sparkform").rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports anywhere in its body (`from a import b` counts as a.b
    when a.b is a module, else as a)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [
                f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                for alias in node.names
            ]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first walk meets, each as the modules along it."""
    found, state = [], {}

    def walk(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                walk(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            walk(node, [node])
    return found


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_inside_the_project():
    modules = project_modules()
    graph = {name: imports_of(path, modules) - {name} for name, path in modules.items()}
    assert {
        "sparkform.domain.model",
        "sparkform.rules.bootchain",
        "sparkform.rules.validate",
        "sparkform.rules.planner",
    } <= set(graph)
    assert cycles(graph) == []


def test_no_two_test_modules_share_a_name():
    """The test folders have no __init__.py: pytest imports each module by its bare name, so a
    second test_x.py in one run (unit and integration; sparkform/verify runs on its own, as
    `sparkform verify`) stops the whole run at collection ("import file mismatch")."""
    modules = sorted((REPO / "tests").glob("unit/test_*.py")) + sorted((REPO / "tests").glob("integration/test_*.py"))
    names = [path.name for path in modules]
    assert len(names) > 20
    assert sorted({name for name in names if names.count(name) > 1}) == []


# --- the rooms of the package, in order ---------------------------------------------------------

# Each floor imports only the floors below it and its own room. The pure core is the middle five:
# what a host is (domain), what it prints read back (readers), the rules over a whole host (rules),
# what the commands show (reports), what lands on it (writers). Below them the programs that run on
# a host, standard library only; above them what connects: the commands, then the deploy (pyinfra),
# the sandbox and the verify suite (testinfra), then the entry points: the command line's and the
# one an inventory file imports.
FLOORS = (
    ("host",),
    ("domain",),
    ("readers",),
    ("rules",),
    ("reports",),
    ("writers",),
    ("commands",),
    ("deploy", "sandbox", "verify"),
    ("cli", "inventory"),
)
CORE_ROOMS = ("domain", "readers", "rules", "reports", "writers")
# What a module of the pure core must never import, at module level or in a function: whatever
# spawns a process or opens a connection.
CONNECTS_OR_SPAWNS = (
    "subprocess", "socket", "ssl", "http.client", "urllib.request", "asyncio", "multiprocessing", "pty",
    "pyinfra", "paramiko", "huggingface_hub", "requests", "httpx", "urllib3",
)  # fmt: skip
MAX_LINES = 450


def room_of(module: str) -> str | None:
    """The room of a module of the package (its first name under sparkform), None for the rest."""
    parts = module.split(".")
    return parts[1] if parts[0] == "sparkform" and len(parts) > 1 else None


def floor_of(room: str) -> int:
    (floor,) = [n for n, rooms in enumerate(FLOORS) if room in rooms]
    return floor


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a room on the same floor or above the importer's, as `module -> module`."""
    found = []
    for name, imported in sorted(graph.items()):
        room = room_of(name)
        if room is None:
            continue
        for other in sorted(imported):
            other_room = room_of(other)
            if other_room not in (None, room) and floor_of(other_room) >= floor_of(room):
                found.append(f"{name} -> {other}")
    return found


def test_every_room_of_the_package_has_its_floor():
    rooms = {room_of(name) for name in project_modules()} - {None}
    assert rooms == {room for floor in FLOORS for room in floor}


def test_each_room_imports_only_the_rooms_below_it():
    modules = project_modules()
    graph = {name: imports_of(path, modules) - {name} for name, path in modules.items()}
    assert upward_imports(graph) == []


def test_the_floor_check_fails_on_a_planted_upward_import(tmp_path):
    """The control: the real graph with one import planted from the spec up to the reports."""
    modules = project_modules()
    graph = {name: imports_of(path, modules) - {name} for name, path in modules.items()}
    planted = tmp_path / "planted.py"
    planted.write_text(modules["sparkform.domain.schema"].read_text() + "\nfrom sparkform.reports import status\n")
    graph["sparkform.domain.schema"] = imports_of(planted, modules) - {"sparkform.domain.schema"}
    assert upward_imports(graph) == ["sparkform.domain.schema -> sparkform.reports.status"]
    graph["sparkform.domain.schema"] |= {"sparkform.sandbox.nspawn"}
    assert "sparkform.domain.schema -> sparkform.sandbox.nspawn" in upward_imports(graph)


def outside_imports(path: Path) -> set[str]:
    """Every module `path` imports that is not the project's, anywhere in its body."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def connecting(names: set[str]) -> set[str]:
    return {n for n in names if any(n == bad or n.startswith(f"{bad}.") for bad in CONNECTS_OR_SPAWNS)}


def pure_core(modules: dict[str, Path]) -> list[str]:
    return sorted(n for n in modules if room_of(n) in CORE_ROOMS)


def reached(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_pure_core_imports_nothing_that_connects_or_spawns():
    """The five rooms of the core, and every module they reach, import no process or network
    module: the commands that do live in sparkform/commands/, the programs that run on a host in
    sparkform/host/, the deploy in sparkform/deploy/, the sandbox in sparkform/sandbox/."""
    modules = project_modules()
    graph = {name: imports_of(path, modules) - {name} for name, path in modules.items()}
    core = pure_core(modules)
    assert {
        "sparkform.domain.schema",
        "sparkform.rules.validate",
        "sparkform.rules.planner",
        "sparkform.writers.render",
        "sparkform.readers.parsers",
        "sparkform.reports.status",
    } <= set(core)
    found = {
        f"{name} (through {other}): {sorted(bad)}"
        for name in core
        for other in reached(graph, name)
        if (bad := connecting(outside_imports(modules[other])))
    }
    assert sorted(found) == []


def test_the_purity_check_finds_a_spawn_inside_a_function(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def later():\n    import subprocess.run\n    from pyinfra.api import operation\n")
    assert connecting(outside_imports(module)) == {"subprocess.run", "pyinfra.api"}
    module.write_text("import shlex\nfrom pathlib import Path\n")
    assert connecting(outside_imports(module)) == set()


def test_no_module_of_the_project_is_over_the_line_limit():
    modules = project_modules()
    lengths = {name: len(path.read_text().splitlines()) for name, path in modules.items()}
    assert {"sparkform.host.guard", "sparkform.commands.status", "deploy"} <= set(lengths)
    assert {name: n for name, n in lengths.items() if n > MAX_LINES} == {}
