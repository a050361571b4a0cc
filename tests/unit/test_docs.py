"""The incident ledger (docs/incidents.md) names the tests that prove each incident: every one must
exist, in the file named where a path is given (a renamed or removed test takes its ledger line with
it). A test is `def test_NAME(` in tests/ or in the verify suite, sparkform/verify/."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LEDGER = REPO / "docs" / "incidents.md"
TEST_ROOTS = (REPO / "tests", REPO / "sparkform" / "verify")
BROKEN_INVENTORIES = REPO / "tests" / "fixtures" / "inventories" / "broken"
BROKEN_CASES = "test_broken_inventory_exits_2_naming_the_field"

TEST_FILE = r"(?:tests|sparkform)/[\w/]+\.py"
# `tests/x.py::test_name` anywhere, and a list item `- `tests/x.py`: `test_a`, `test_b` (a note)`.
PATH_AND_NAME = re.compile(rf"`({TEST_FILE})::(test_\w+)(?:\[([\w-]+)\])?`")
FILE_ITEM = re.compile(rf"^- `({TEST_FILE})`: (.+)$", re.M)
NAME = re.compile(r"`(test_\w+)(?:\[([\w-]+)\])?`")


def named_tests(text: str) -> list[tuple[str | None, str, str | None]]:
    """Every test the ledger names, as (file or None, test, parametrize id or None)."""
    named = [(path, name, case) for path, name, case in PATH_AND_NAME.findall(text)]
    for path, rest in FILE_ITEM.findall(text):
        named += [(path, name, case) for name, case in NAME.findall(rest)]
    leftover = FILE_ITEM.sub("", PATH_AND_NAME.sub("", text))
    named += [(None, name, case) for name, case in NAME.findall(leftover)]
    return [(path, name, case or None) for path, name, case in named]


def defines(source: str, name: str) -> bool:
    return re.search(rf"^\s*(?:async\s+)?def {name}\(", source, re.M) is not None


def missing_tests(text: str) -> list[str]:
    sources = {path: path.read_text() for root in TEST_ROOTS for path in root.rglob("*.py")}
    sources = {path.relative_to(REPO).as_posix(): source for path, source in sources.items()}
    missing = []
    for path, name, case in named_tests(text):
        if path is not None:
            found = path in sources and defines(sources[path], name)
            where = f"{path}::{name}"
        else:
            found = any(defines(source, name) for source in sources.values())
            where = name
        if not found:
            missing.append(where)
        elif name == BROKEN_CASES and case is not None and not (BROKEN_INVENTORIES / f"{case}.py").exists():
            missing.append(f"{where}[{case}]: no tests/fixtures/inventories/broken/{case}.py")
    return sorted(set(missing))


def test_every_test_the_incident_ledger_names_exists():
    text = LEDGER.read_text()
    assert len(named_tests(text)) > 150  # the ledger's lists were read, not skipped
    assert missing_tests(text) == []


def test_every_incident_names_its_tests():
    entries = re.split(r"(?m)^### ", LEDGER.read_text().split("## What sparkform does not answer")[0])[1:]
    assert len(entries) >= 30  # every entry was found
    assert [entry.split("\n", 1)[0] for entry in entries if "**Tests.**" not in entry] == []


def test_the_ledger_check_can_fail():
    ledger = (
        "**Tests.**\n"
        "- `tests/unit/test_docs.py`: `test_the_ledger_check_can_fail`, `test_gone_from_this_file`\n"
        "- `tests/unit/test_readme.py::test_docs_field_table_matches_schema`\n"
        "- `tests/unit/test_docs.py::test_docs_field_table_matches_schema` (in another file)\n"
        "- `tests/unit/test_cli.py`: `test_broken_inventory_exits_2_naming_the_field[no_such_case]`\n"
        "Also `test_nowhere_at_all`, and `test_every_incident_names_its_tests`.\n"
    )
    assert missing_tests(ledger) == [
        "test_nowhere_at_all",
        "tests/unit/test_cli.py::test_broken_inventory_exits_2_naming_the_field[no_such_case]: "
        "no tests/fixtures/inventories/broken/no_such_case.py",
        "tests/unit/test_docs.py::test_docs_field_table_matches_schema",
        "tests/unit/test_docs.py::test_gone_from_this_file",
    ]
