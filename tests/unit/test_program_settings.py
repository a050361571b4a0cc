"""Each host program's settings file, as the core writes it and as the program reads it, held to one
shape: sparkform.host's TypedDicts (GuardSettings, ScrubSettings, RollbackSettings and the shapes
nested in them).

The writer: the settings sparkform.writers.programs builds for the sample hosts and the valid
inventories have the keys of their shape at every level, each required key present and no key
the shape lacks, with values of the declared types; every nested shape is met at least once.

The reader: a walk over the syntax of each program and of the sparkform.host modules it imports
follows each value of a shape, from a parameter or a name annotated with it to what is read from
it (an engine of `config["engines"]`, its probe, the checkpoint of a loop). Every `x["key"]` and
`x.get("key")` on such a value must name a key of its shape. A shape passed to a host function
whose parameter declares none fails too: the walk would not see what that function reads. The
controls plant an unknown key, a nested one and an undeclared parameter, and each is caught.
"""

from __future__ import annotations

import ast
import copy
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from samples import CPU_PAIR, SERVED_PAIR

import sparkform.host as host_package
from sparkform.domain.engine import Span
from sparkform.domain.model import Host
from sparkform.rules.inventory import load_host, load_inventory
from sparkform.writers import programs

HOST_MODULES = Path(host_package.__file__).parent
INVENTORIES = Path(__file__).resolve().parents[1] / "fixtures" / "inventories"
VALID_INVENTORIES = ("valid_pair.py", "monitored.py")  # served_pair.py comes from samples
# Every TypedDict of sparkform.host, by the name an annotation gives it.
SHAPES: dict[str, type] = {name: value for name, value in vars(host_package).items() if typing.is_typeddict(value)}
# The programs that read a settings file: its shape and the core's settings for a host.
SETTINGS: dict[str, tuple[type, Callable[[Host], Any]]] = {
    "guard": (host_package.GuardSettings, lambda host: programs.guard_settings(host.config, host.model_configs)),
    "scrub": (host_package.ScrubSettings, lambda host: programs.scrub_settings(host.config)),
    "rollback": (host_package.RollbackSettings, lambda host: programs.rollback_settings(host.config)),
}
# The shapes nested in each that its program reads keys of (the ledger's settings and prediction
# it passes on whole).
NESTED_READS = {
    "guard": ("GuardEngine", "EngineProbe", "EngineLedger", "AwaitedRanks", "GuardedFront"),
    "scrub": ("ServedCheckpoint", "CheckpointEngine"),
    "rollback": ("RollbackEngine",),
}


# --- shapes as types -------------------------------------------------------------------------------


def fields(shape: type) -> dict[str, Any]:
    """A shape's keys and their types (NotRequired dropped: the keys say which are optional)."""
    return typing.get_type_hints(shape)


def keys(shape: type) -> frozenset[str]:
    return shape.__required_keys__ | shape.__optional_keys__


def is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def bare(hint: Any) -> Any:
    """The hint without its None (`X | None` is X where a value is read)."""
    if is_union(hint):
        rest = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return rest[0] if len(rest) == 1 else None
    return hint


def element(hint: Any) -> Any:
    """What a loop over a value of this hint yields (a dict's values for a subscript)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list:
        return args[0]
    if origin is dict:
        return args[1]
    return None


def holds_shape(hint: Any) -> bool:
    if typing.is_typeddict(hint):
        return True
    return any(holds_shape(arg) for arg in typing.get_args(hint))


def shapes_within(shape: type) -> set[type]:
    """The shape and every shape nested in it."""
    found = {shape}

    def walk(hint: Any) -> None:
        if typing.is_typeddict(hint) and hint not in found:
            found.add(hint)
            for inner in fields(hint).values():
                walk(inner)
        for arg in typing.get_args(hint):
            walk(arg)

    for hint in fields(shape).values():
        walk(hint)
    return found


def hint_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint)


# --- the writer: the core's settings against their shape --------------------------------------------


def shape_problems(value: Any, hint: Any, where: str, met: set[type]) -> list[str]:
    """Where `value` is not of `hint`: a missing required key, a key the shape lacks, a value of
    another type. `met` collects the shapes the value holds."""
    if typing.is_typeddict(hint):
        if not isinstance(value, dict):
            return [f"{where}: a {type(value).__name__}, not a {hint.__name__}"]
        met.add(hint)
        problems = [
            f"{where}: no {key!r}, which {hint.__name__} requires"
            for key in sorted(hint.__required_keys__ - value.keys())
        ]
        problems += [f"{where}: {key!r} is not a key of {hint.__name__}" for key in sorted(value.keys() - keys(hint))]
        types_of = fields(hint)
        for key in sorted(value.keys() & keys(hint)):
            problems += shape_problems(value[key], types_of[key], f"{where}[{key!r}]", met)
        return problems
    if is_union(hint):
        tries = []
        for arg in typing.get_args(hint):
            met_here: set[type] = set()
            problems = shape_problems(value, arg, where, met_here)
            if not problems:
                met |= met_here
                return []
            tries += problems
        return tries
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list:
        if not isinstance(value, list):
            return [f"{where}: a {type(value).__name__}, not a list"]
        return [
            problem for i, item in enumerate(value) for problem in shape_problems(item, args[0], f"{where}[{i}]", met)
        ]
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
            return [f"{where}: not a dict with str keys"]
        return [
            problem
            for key, item in value.items()
            for problem in shape_problems(item, args[1], f"{where}[{key!r}]", met)
        ]
    if hint is object:
        return []
    if hint is type(None):
        return [] if value is None else [f"{where}: {value!r}, not None"]
    accepted = (int, float) if hint is float else hint  # an int is a float too (PEP 484)
    if isinstance(value, bool) and hint is not bool or not isinstance(value, accepted):
        return [f"{where}: {value!r} is not a {hint_name(hint)}"]
    return []


def spanning(head: bool) -> Host:
    """CPU_PAIR's box running `slow` across two hosts: as its head (ranks to wait for) or as the
    worker (a head elsewhere)."""
    data = copy.deepcopy(CPU_PAIR)
    data["node_interface"] = "enp1s0f1np1"
    slow = data["engines"][0]
    slow["nodes"] = ["box", "other"] if head else ["other", "box"]
    if head:
        data["node_address"] = "10.0.0.1"
    host = load_host("box", data)
    spans = {"slow": Span("10.0.0.1", "10.0.0.1" if head else "10.0.0.2", "10.0.0.0/30")}
    return Host(host.name, host.config.spanned(spans), host.model_configs)


@pytest.fixture
def sample_hosts(monkeypatch) -> dict[str, Host]:
    """The served pair (its key file and host key as conftest gives them), the valid inventories,
    the CPU pair, and that pair with an engine across hosts, on its head and on its worker."""
    for var in ("SPARK_HOST", "SPARK_USER", "SPARK_HF_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    hosts = {f"served_pair {host.name}": host for host in load_inventory(SERVED_PAIR)}
    for inventory in VALID_INVENTORIES:
        hosts |= {f"{inventory} {host.name}": host for host in load_inventory(INVENTORIES / inventory)}
    hosts["CPU_PAIR"] = load_host("box", copy.deepcopy(CPU_PAIR))
    hosts["CPU_PAIR, a head across hosts"] = spanning(head=True)
    hosts["CPU_PAIR, a worker across hosts"] = spanning(head=False)
    return hosts


def test_the_core_writes_each_settings_file_in_its_shape(sample_hosts):
    met: set[type] = set()
    problems = [
        problem
        for name, host in sample_hosts.items()
        for program, (shape, settings) in SETTINGS.items()
        for problem in shape_problems(settings(host), shape, f"{name}: sparkform-{program}.json", met)
    ]
    assert not problems, "\n".join(problems)
    # Each nested shape was there to check (a head's awaited ranks, a rollback's engine, ...).
    declared = set().union(*(shapes_within(shape) for shape, _ in SETTINGS.values()))
    assert {shape.__name__ for shape in declared - met} == set()


def test_the_writer_check_finds_a_key_the_shape_lacks_and_a_missing_one(sample_hosts):
    met: set[type] = set()
    settings = SETTINGS["guard"][1](sample_hosts["CPU_PAIR"])
    settings["no_such_key"] = 1
    del settings["engines"][0]["unit"]
    assert shape_problems(settings, host_package.GuardSettings, "guard", met) == [
        "guard: 'no_such_key' is not a key of GuardSettings",
        "guard['engines'][0]: no 'unit', which GuardEngine requires",
    ]


# --- the reader: what each program reads from its settings ----------------------------------------


@dataclass(frozen=True)
class Callee:
    module: str
    name: str  # as the report names it: function, Class or Class.method
    node: ast.FunctionDef
    bound: bool  # a method or a class: its first parameter is self


@dataclass
class Scope:
    """What the walk knows inside one function: the shapes of names and of self's attributes,
    and the dicts of functions a call may pick from."""

    module: str
    function: str
    names: dict[str, Any] = field(default_factory=dict)
    attributes: dict[str, Any] = field(default_factory=dict)
    dispatch: dict[str, list[Callee]] = field(default_factory=dict)

    def inner(self, function: str | None = None) -> Scope:
        return Scope(self.module, function or self.function, dict(self.names), self.attributes, dict(self.dispatch))


def annotation_shape(node: ast.expr | None) -> Any:
    """The shape an annotation names (`X`, `X | None`, or either quoted); None for any other."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return annotation_shape(ast.parse(node.value, mode="eval").body)
    if isinstance(node, ast.Name):
        return SHAPES.get(node.id)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        if isinstance(node.right, ast.Constant) and node.right.value is None:
            return annotation_shape(node.left)
    return None


def string_key(node: ast.expr) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


class Reader:
    """The walk over one program's modules: `problems` (a key its shape lacks, a shape passed to a
    parameter that declares none), the keys read of each shape, and which shape each function
    that opens the settings file (settings_path) binds."""

    def __init__(self, program: str, sources: dict[str, str]):
        self.trees = {name: ast.parse(sources[name], f"{name}.py") for name in imported(program, sources)}
        self.imports = {name: import_bindings(tree, sources) for name, tree in self.trees.items()}
        self.problems: list[str] = []
        self.read: dict[type, set[str]] = {}
        self.loaders: dict[str, set[type]] = {}
        for module, tree in self.trees.items():
            for node in tree.body:
                if isinstance(node, ast.FunctionDef):
                    self.function(node, Scope(module, node.name))
                elif isinstance(node, ast.ClassDef):
                    self.class_methods(node, module)

    # -- the program's functions --

    def class_methods(self, node: ast.ClassDef, module: str) -> None:
        methods = [item for item in node.body if isinstance(item, ast.FunctionDef)]
        attributes: dict[str, Any] = {}
        # __init__ first: what it puts on self is known in every other method.
        for method in sorted(methods, key=lambda m: m.name != "__init__"):
            self.function(method, Scope(module, f"{node.name}.{method.name}", attributes=attributes))

    def function(self, node: ast.FunctionDef | ast.Lambda, scope: Scope) -> None:
        arguments = node.args
        for argument in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]:
            shape = annotation_shape(argument.annotation)
            if shape is not None:
                scope.names[argument.arg] = shape
            else:
                scope.names.pop(argument.arg, None)
        for default in [*arguments.defaults, *arguments.kw_defaults]:
            if default is not None:
                self.expression(default, scope)
        if isinstance(node, ast.Lambda):
            self.expression(node.body, scope)
            return
        opens = any(
            isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "settings_path"
            for call in ast.walk(node)
        )
        self.block(node.body, scope)
        if opens:
            self.loaders[f"{scope.module}.{scope.function}"] = {
                hint for hint in scope.names.values() if typing.is_typeddict(hint)
            }

    def block(self, statements: list[ast.stmt], scope: Scope) -> None:
        for statement in statements:
            self.statement(statement, scope)

    def statement(self, node: ast.AST, scope: Scope) -> None:
        if isinstance(node, ast.FunctionDef):  # a closure: it sees the names around it
            for decorator in node.decorator_list:
                self.expression(decorator, scope)
            self.function(node, scope.inner(f"{scope.function}.{node.name}"))
        elif isinstance(node, ast.Assign):
            self.expression(node.value, scope)
            for target in node.targets:
                self.bind(target, node.value, scope)
        elif isinstance(node, ast.AnnAssign):
            if node.value is not None:
                self.expression(node.value, scope)
            shape = annotation_shape(node.annotation)
            if shape is not None:
                self.bind_hint(node.target, shape, scope)
            elif node.value is not None:
                self.bind(node.target, node.value, scope)
        elif isinstance(node, ast.For):
            self.expression(node.iter, scope)
            self.bind_hint(node.target, element(bare(self.type_of(node.iter, scope))), scope)
            self.block(node.body, scope)
            self.block(node.orelse, scope)
        elif isinstance(node, ast.expr):
            self.expression(node, scope)
        else:
            for child in ast.iter_child_nodes(node):
                self.statement(child, scope)

    def bind(self, target: ast.expr, value: ast.expr, scope: Scope) -> None:
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
            for one, its in zip(target.elts, value.elts, strict=True):
                self.bind(one, its, scope)
            return
        if isinstance(target, ast.Name) and isinstance(value, ast.Dict):
            callees = [self.resolve(item, scope) for item in value.values]
            if callees and all(len(found) == 1 for found in callees):  # a table of functions to call
                scope.dispatch[target.id] = [found[0] for found in callees]
                return
        self.bind_hint(target, self.type_of(value, scope), scope)

    def bind_hint(self, target: ast.expr, hint: Any, scope: Scope) -> None:
        known = hint is not None and holds_shape(hint)
        if isinstance(target, ast.Name):
            scope.dispatch.pop(target.id, None)
            if known:
                scope.names[target.id] = hint
            else:
                scope.names.pop(target.id, None)
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
            if known:
                scope.attributes[target.attr] = hint
            else:
                scope.attributes.pop(target.attr, None)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for one in target.elts:
                self.bind_hint(one, None, scope)

    # -- expressions: what is read, and what is passed on --

    def expression(self, node: ast.expr, scope: Scope) -> None:
        if isinstance(node, ast.Lambda):
            self.function(node, scope.inner())
            return
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            inner = self.comprehension(node, scope, walk=True)
            for part in (node.key, node.value) if isinstance(node, ast.DictComp) else (node.elt,):
                self.expression(part, inner)
            return
        if isinstance(node, ast.NamedExpr):
            self.expression(node.value, scope)
            self.bind(node.target, node.value, scope)
            return
        self.key_read(node, scope)
        sort_key = None
        if isinstance(node, ast.Call):
            self.passed(node, scope)
            sort_key = self.sort_key(node, scope)
        for child in ast.iter_child_nodes(node):
            value = child.value if isinstance(child, ast.keyword) else child
            if sort_key is not None and value is sort_key[0]:
                inner = scope.inner()
                for argument in sort_key[0].args.args:  # its parameters shadow the names around it
                    inner.names.pop(argument.arg, None)
                inner.names[sort_key[0].args.args[0].arg] = sort_key[1]
                self.expression(sort_key[0].body, inner)
            elif isinstance(value, ast.expr):
                self.expression(value, scope)

    def sort_key(self, node: ast.Call, scope: Scope) -> tuple[ast.Lambda, Any] | None:
        """The key function of sorted(), min() or max() over shapes, and the shape of its parameter."""
        if not (isinstance(node.func, ast.Name) and node.func.id in ("sorted", "min", "max") and node.args):
            return None
        item = element(bare(self.type_of(node.args[0], scope)))
        for keyword in node.keywords:
            if keyword.arg == "key" and isinstance(keyword.value, ast.Lambda) and keyword.value.args.args and item:
                return keyword.value, item
        return None

    def comprehension(self, node: ast.expr, scope: Scope, walk: bool = False) -> Scope:
        inner = scope.inner()
        for generator in node.generators:
            if walk:
                self.expression(generator.iter, inner)
            self.bind_hint(generator.target, element(bare(self.type_of(generator.iter, inner))), inner)
            if walk:
                for condition in generator.ifs:
                    self.expression(condition, inner)
        return inner

    def key_read(self, node: ast.expr, scope: Scope) -> None:
        """A key read of a shape: `x["key"]` or `x.get("key", ...)`."""
        if isinstance(node, ast.Subscript):
            base, key = node.value, node.slice
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            if not node.args:
                return
            base, key = node.func.value, node.args[0]
        else:
            return
        shape = bare(self.type_of(base, scope))
        if not typing.is_typeddict(shape):
            return
        where = f"{scope.module}.py:{node.lineno} ({scope.function})"
        name = string_key(key)
        if name is None:
            self.problems.append(f"{where}: reads {shape.__name__} by a computed key: {ast.unparse(node)}")
        elif name not in keys(shape):
            self.problems.append(f"{where}: {ast.unparse(node)} reads {name!r}, not a key of {shape.__name__}")
        else:
            self.read.setdefault(shape, set()).add(name)

    def passed(self, node: ast.Call, scope: Scope) -> None:
        """A shape passed to a host function must land in a parameter annotated with that shape."""
        arguments, keywords = node.args, {k.arg: k.value for k in node.keywords if k.arg}
        callees = self.resolve(node.func, scope)
        if isinstance(node.func, ast.Attribute) and node.func.attr == "Thread" and "target" in keywords:
            callees = self.resolve(keywords.pop("target"), scope)
            given = keywords.pop("args", None)
            arguments, keywords = (list(given.elts) if isinstance(given, ast.Tuple) else []), {}
        for callee in callees:
            parameters = [*callee.node.args.posonlyargs, *callee.node.args.args][1 if callee.bound else 0 :]
            by_name = {p.arg: p for p in [*parameters, *callee.node.args.kwonlyargs]}
            pairs = []
            for argument, parameter in zip(arguments, parameters, strict=False):
                if isinstance(argument, ast.Starred):
                    break
                pairs.append((argument, parameter))
            pairs += [(value, by_name[name]) for name, value in keywords.items() if name in by_name]
            for argument, parameter in pairs:
                hint = self.type_of(argument, scope)
                if hint is None or not holds_shape(hint):
                    continue
                declared = annotation_shape(parameter.annotation)
                if bare(declared) != bare(hint):
                    self.problems.append(
                        f"{scope.module}.py:{node.lineno} ({scope.function}): passes a {hint_name(bare(hint))} to "
                        f"{callee.module}.{callee.name}'s parameter {parameter.arg!r}, which declares "
                        f"{hint_name(declared) if declared else 'no shape'}"
                    )

    def resolve(self, node: ast.expr, scope: Scope) -> list[Callee]:
        """The host functions a call of `node` runs: by name, by module, a method of self, a table's."""
        if isinstance(node, ast.Name):
            if node.id in scope.dispatch:
                return scope.dispatch[node.id]
            module, name = self.imports[scope.module].get(node.id, (scope.module, node.id))
            return self.callees_named(module, name)
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
            return scope.dispatch.get(node.value.id, [])
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "self" and "." in scope.function:
                klass = scope.function.split(".")[0]
                return [c for c in self.callees_named(scope.module, klass, node.attr) if c.bound]
            module, name = self.imports[scope.module].get(node.value.id, (None, None))
            if module is not None and name is None:
                return self.callees_named(module, node.attr)
        return []

    def callees_named(self, module: str, name: str, method: str = "__init__") -> list[Callee]:
        for node in self.trees[module].body if module in self.trees else []:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return [Callee(module, name, node, bound=False)]
            if isinstance(node, ast.ClassDef) and node.name == name:
                return [
                    Callee(module, f"{name}.{item.name}", item, bound=True)
                    for item in node.body
                    if isinstance(item, ast.FunctionDef) and item.name == method
                ]
        return []

    # -- the shape of an expression --

    def type_of(self, node: ast.expr, scope: Scope) -> Any:
        if isinstance(node, ast.Name):
            return scope.names.get(node.id)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            return scope.attributes.get(node.attr)
        if isinstance(node, ast.Subscript):
            base = bare(self.type_of(node.value, scope))
            if typing.is_typeddict(base):
                return fields(base).get(string_key(node.slice) or "")
            if isinstance(node.slice, ast.Slice):
                return base
            return element(base)
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "get" and node.args:
                base = bare(self.type_of(func.value, scope))
                if typing.is_typeddict(base):
                    return fields(base).get(string_key(node.args[0]) or "")
                return element(base)
            if isinstance(func, ast.Name) and func.id in ("sorted", "reversed", "list") and node.args:
                return self.type_of(node.args[0], scope)
            callees = self.resolve(func, scope)
            return annotation_shape(callees[0].node.returns) if len(callees) == 1 and not callees[0].bound else None
        if isinstance(node, (ast.ListComp, ast.GeneratorExp)):
            item = self.type_of(node.elt, self.comprehension(node, scope))
            return list[item] if item is not None and holds_shape(item) else None
        if isinstance(node, ast.DictComp):
            item = self.type_of(node.value, self.comprehension(node, scope))
            return dict[str, item] if item is not None and holds_shape(item) else None
        if isinstance(node, ast.IfExp):
            return self.type_of(node.body, scope) or self.type_of(node.orelse, scope)
        return None


def imported(program: str, sources: dict[str, str]) -> list[str]:
    """The program's module and every sparkform.host module it imports, at any depth."""
    found, todo = [], [program]
    while todo:
        module = todo.pop()
        if module in found:
            continue
        found.append(module)
        for bound in import_bindings(ast.parse(sources[module]), sources).values():
            todo.append(bound[0])
    return found


def import_bindings(tree: ast.Module, sources: dict[str, str]) -> dict[str, tuple[str, str | None]]:
    """A module's imports of sparkform.host modules, by the name they take: (module, None) for a
    module, (module, function) for a name from one."""
    bindings: dict[str, tuple[str, str | None]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("sparkform.host"):
            continue
        for alias in node.names:
            local = alias.asname or alias.name
            if node.module == "sparkform.host" and alias.name in sources:
                bindings[local] = (alias.name, None)
            elif node.module and node.module.startswith("sparkform.host."):
                bindings[local] = (node.module.rsplit(".", 1)[1], alias.name)
    return bindings


def host_sources(**planted: Callable[[str], str]) -> dict[str, str]:
    """The text of every module of sparkform.host, by name; `planted` changes some."""
    sources = {path.stem: path.read_text() for path in HOST_MODULES.glob("*.py") if path.stem != "__init__"}
    for module, change in planted.items():
        changed = change(sources[module])
        assert changed != sources[module], f"the plant found nothing to change in {module}.py"
        sources[module] = changed
    return sources


@pytest.mark.parametrize("program", programs.PROGRAMS)
def test_each_program_reads_only_keys_of_its_shape(program):
    reader = Reader(program, host_sources())
    assert not reader.problems, "\n".join(reader.problems)
    if program not in SETTINGS:
        assert reader.loaders == {}, f"sparkform-{program} opens a settings file that has no shape"
        return
    shape = SETTINGS[program][0]
    # The function that opens the settings file holds them as their shape, and the walk followed it.
    assert reader.loaders and all(shape in bound for bound in reader.loaders.values()), reader.loaders
    assert reader.read.get(shape), f"the walk found no read of {shape.__name__} in sparkform-{program}"


def test_the_reader_check_finds_unknown_keys_and_an_undeclared_parameter():
    sources = host_sources(
        outages=lambda text: text.replace('config["state_dir"], f"outage-', 'config["state_folder"], f"outage-'),
        watchdog=lambda text: text.replace('spec["route"]', 'spec["path"]'),
        target=lambda text: text.replace("def target_down(config: GuardSettings):", "def target_down(config):"),
    )
    problems = Reader("guard", sources).problems
    assert len(problems) == 4, "\n".join(problems)
    assert any(
        line.startswith("outages.py:")
        and "(outage_path): config['state_folder'] reads 'state_folder', not a key of GuardSettings" in line
        for line in problems
    )
    assert any("watchdog.py" in line and "reads 'path', not a key of EngineProbe" in line for line in problems)
    # Both callers of target_down pass it the settings; neither is followed into it any more.
    undeclared = [
        line for line in problems if "to target.target_down's parameter 'config', which declares no shape" in line
    ]
    assert len(undeclared) == 2, problems


@pytest.mark.parametrize("program", SETTINGS)
def test_the_walk_reaches_the_nested_shapes(program):
    """What a loop, a comprehension, a table or a sort key yields: the guard's engines, their probe
    and ledger, a head's ranks, the fronts; the scrub's checkpoints and their engines; the
    rollback's engine by its name."""
    read = Reader(program, host_sources()).read
    assert [name for name in NESTED_READS[program] if not read.get(SHAPES[name])] == []
