"""The project's modules import each other without a cycle, at module level or inside a function:
the core builds upward from the schema and the model types, and the tasks and facts on the core."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("sparkform", "tasks", "facts")


def project_modules() -> dict[str, Path]:
    """Every module of the project by dotted name, deploy.py included."""
    modules = {"deploy": REPO / "deploy.py"}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
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
    assert {"sparkform.model", "sparkform.bootchain", "sparkform.validate", "sparkform.planner"} <= set(graph)
    assert cycles(graph) == []


def test_no_two_test_modules_share_a_name():
    """The test folders have no __init__.py: pytest imports each module by its bare name, so a
    second test_x.py in one run (unit and integration; tests/verify runs on its own, as
    `sparkform verify`) stops the whole run at collection ("import file mismatch")."""
    modules = sorted((REPO / "tests").glob("unit/test_*.py")) + sorted((REPO / "tests").glob("integration/test_*.py"))
    names = [path.name for path in modules]
    assert len(names) > 20
    assert sorted({name for name in names if names.count(name) > 1}) == []


# --- the layout by role ----------------------------------------------------------------------------

# What a module of the pure core must never import, at module level or in a function: whatever
# spawns a process or opens a connection.
CONNECTS_OR_SPAWNS = (
    "subprocess", "socket", "ssl", "http.client", "urllib.request", "asyncio", "multiprocessing", "pty",
    "pyinfra", "paramiko", "huggingface_hub", "requests", "httpx", "urllib3",
)  # fmt: skip
# sparkform/*.py is the pure core, but for the entry point that dispatches to the commands.
ENTRY_POINT = "sparkform.cli"
MAX_LINES = 450


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
    return sorted(n for n in modules if n.count(".") == 1 and n.startswith("sparkform.") and n != ENTRY_POINT)


def reached(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_pure_core_imports_nothing_that_connects_or_spawns():
    """The schema, validation, planner, rendering and parsers, and every module they reach, import
    no process or network module: the commands that do live in sparkform/commands/, the programs
    that run on a host in sparkform/host/, the sandbox in sparkform/sandbox/."""
    modules = project_modules()
    graph = {name: imports_of(path, modules) - {name} for name, path in modules.items()}
    core = pure_core(modules)
    assert {
        "sparkform.schema",
        "sparkform.validate",
        "sparkform.planner",
        "sparkform.render",
        "sparkform.parsers",
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
