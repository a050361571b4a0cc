"""`sparkform init`: the shipped inventory (inventory/spark.py) written anew with the options'
values in its block marked `sparkform init`, each a literal; the copy plans, serves the pair alone,
reads no environment variable, and keeps every other value and comment of the shipped file.

The expectations come from the shipped file itself (its block's defaults, its engines), so the
owner's edits of inventory/spark.py keep these tests true."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

from sparkform import cli
from sparkform.commands import init
from sparkform.domain.engine import Measured
from sparkform.domain.model import Host
from sparkform.rules.inventory import DEFAULT_INVENTORY, load_inventory, planning, raw_inventory

SHIPPED = init.shipped_defaults()
SPARK_VARIABLES = ("SPARK_HOST", "SPARK_USER", "SPARK_HF_TOKEN_FILE", "SPARK_LISTEN_ADDRESS", "SPARK_API_KEY_FILE")


@pytest.fixture
def no_spark_variables(monkeypatch) -> None:
    for variable in SPARK_VARIABLES:
        monkeypatch.delenv(variable, raising=False)


def planned(path: Path) -> Host:
    """The one host of the inventory at `path`, loaded as `sparkform plan` loads it."""
    with planning():
        (host,) = load_inventory(path)
    return host


def pyinfra_data(path: Path) -> tuple[str, dict[str, Any]]:
    """The one host of the inventory at `path` and its data as pyinfra reads them."""
    with planning():
        ((name, data),) = raw_inventory(path).items()
    return name, data


def test_the_copy_holds_the_options_and_plans(tmp_path, capsys):
    path = tmp_path / "my-spark.py"
    options = ["--host", "gb10.lan", "--user", "ops", "--listen-address", "127.0.0.1"]
    assert cli.main(["init", str(path), *options]) == 0
    said = capsys.readouterr().out
    assert said.startswith(f"wrote {path}: gb10.lan serving {SHIPPED['FAST_NAME']} ({SHIPPED['FAST_MODEL']}) on ")
    assert f"  sparkform plan {path}  " in said and f"export SPARKFORM_INVENTORY={path}" in said
    _, data = pyinfra_data(path)
    assert (data["ssh_user"], data["_sudo"], data["listen_address"]) == ("ops", True, "127.0.0.1")
    host = planned(path)
    assert host.name == "gb10.lan"
    assert [(e.name, e.checkpoint.repo, e.port) for e in host.config.engines] == [
        (SHIPPED["FAST_NAME"], SHIPPED["FAST_MODEL"], SHIPPED["FAST_PORT"]),
        (SHIPPED["CAREFUL_NAME"], SHIPPED["CAREFUL_MODEL"], SHIPPED["CAREFUL_PORT"]),
    ]
    assert cli.main(["plan", str(path)]) == 0
    assert "host gb10.lan: " in capsys.readouterr().out


def test_the_copy_serves_the_shipped_pair_as_the_shipped_inventory_does(tmp_path, no_spark_variables):
    """One source: with the defaults, the copy's engines are the shipped inventory's pair, field for field."""
    path = tmp_path / "copy.py"
    assert cli.main(["init", str(path), "--host", str(SHIPPED["HOST"])]) == 0
    shipped, copy = planned(init.SHIPPED), planned(path)
    pair = {SHIPPED["FAST_NAME"], SHIPPED["CAREFUL_NAME"]}
    assert [e.model_dump() for e in copy.config.engines] == [
        e.model_dump() for e in shipped.config.engines if e.name in pair
    ]
    assert copy.config.pin() == shipped.config.pin()
    # Every comment of the shipped file is kept but the docstring's.
    comments = {line.strip() for line in init.SHIPPED.read_text().splitlines() if line.strip().startswith("#")}
    assert comments <= {line.strip() for line in path.read_text().splitlines()}


def test_another_checkpoint_starts_without_the_served_pairs_settings(tmp_path, capsys):
    path = tmp_path / "other.py"
    options = ["--fast-name", "quick", "--fast-model", "org/fast-model", "--fast-port", "9001"]
    options += ["--careful-name", "slow", "--careful-model", "org/slow-model", "--careful-port", "9002"]
    assert cli.main(["init", str(path), "--host", "box", *options]) == 0
    assert "box serving quick (org/fast-model) on :9001 and slow (org/slow-model) on :9002" in capsys.readouterr().out
    quick, slow = planned(path).config.engines
    for engine, name in ((quick, "quick"), (slow, "slow")):
        assert engine.served_names == [name] and engine.measured == Measured()
        assert (engine.quantization, engine.tool_call_parser, engine.multimodal) == (None, None, False)
    assert slow.after == ["quick"]
    assert cli.main(["plan", str(path)]) == 0


def test_the_copy_reads_no_environment_variable(tmp_path, monkeypatch):
    path = tmp_path / "copy.py"
    assert cli.main(["init", str(path), "--host", "box"]) == 0
    tree = ast.parse(path.read_text())
    assert not [node for node in ast.walk(tree) if isinstance(node, ast.Import) or getattr(node, "id", "") == "os"]
    for variable in SPARK_VARIABLES:
        monkeypatch.setenv(variable, "elsewhere")
    name, data = pyinfra_data(path)
    assert name == "box" and data["ssh_user"] == SHIPPED["SSH_USER"]
    assert data["listen_address"] == SHIPPED["LISTEN_ADDRESS"] and data["api_key_file"] == SHIPPED["API_KEY_FILE"]


def test_a_path_of_quotes_and_backslashes_stays_inside_the_docstring(tmp_path):
    folder = tmp_path / 'we"""ird\\'
    folder.mkdir()
    path = folder / 'x"y.py'
    assert cli.main(["init", str(path), "--host", "box"]) == 0
    docstring = ast.get_docstring(ast.parse(path.read_text()))
    assert f"sparkform plan {path} " in docstring
    assert planned(path).name == "box"


def test_the_default_path_and_the_defaults_are_the_shipped_inventorys(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cli.main(["init", "--host", "box"]) == 0
    written = Path(DEFAULT_INVENTORY).expanduser()
    assert written.is_relative_to(tmp_path) and written.is_file()
    with pytest.raises(SystemExit):
        cli.main(["init", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for name in ("FAST_NAME", "FAST_MODEL", "FAST_PORT", "CAREFUL_NAME", "CAREFUL_MODEL", "CAREFUL_PORT"):
        assert f"(default {SHIPPED[name]})" in shown
    assert f"(default {SHIPPED['LISTEN_ADDRESS']}: the LAN" in shown


def test_an_existing_file_is_kept_unless_forced(tmp_path, capsys):
    path = tmp_path / "mine.py"
    path.write_text("kept\n")
    assert cli.main(["init", str(path), "--host", "box"]) == 2
    assert capsys.readouterr().err == f"sparkform init: {path} exists: keep it, or write it anew with --force\n"
    assert path.read_text() == "kept\n"
    assert cli.main(["init", str(path), "--host", "box", "--force"]) == 0
    assert planned(path).name == "box"


@pytest.mark.parametrize(
    "options", [["--fast-name", "same", "--careful-name", "same"], ["--fast-port", "9000", "--careful-port", "9000"]]
)
def test_the_two_engines_need_names_and_ports_of_their_own(tmp_path, capsys, options):
    path = tmp_path / "pair.py"
    assert cli.main(["init", str(path), "--host", "box", *options]) == 2
    assert capsys.readouterr().err == "sparkform init: the two engines need names and ports of their own\n"
    assert not path.exists()


@pytest.mark.parametrize(
    ("option", "value", "said"),
    [
        ("--host", "bad host", "'bad host' is not a host name"),
        ("--user", "Root", "'Root' is not a user name"),
        ("--listen-address", "spark.local", "'spark.local' is not an IP address"),
        ("--fast-model", "notarepo", "'notarepo' is not a Hugging Face repo id (org/name)"),
        ("--careful-name", "Bad_Name", "'Bad_Name' is not an engine name (a-z 0-9 -)"),
        ("--fast-port", "x", "invalid int value: 'x'"),
        ("--host", 'box"\nimport os', "is not a host name"),
    ],
)
def test_an_option_of_another_shape_exits_2_before_writing(tmp_path, capsys, option, value, said):
    path = tmp_path / "refused.py"
    arguments = ["init", str(path), *(["--host", "box"] if option != "--host" else []), option, value]
    with pytest.raises(SystemExit) as caught:
        cli.main(arguments)
    assert caught.value.code == 2
    assert said in capsys.readouterr().err
    assert not path.exists()


@pytest.mark.parametrize("value", ["spark.local", 'a"b', "it's", "back\\slash", "ä", 8012, None, False])
def test_each_value_is_written_as_the_literal_it_is(value):
    assert ast.literal_eval(init.literal(value)) == value


BLOCK = f'''"""An inventory."""

import os

{init.BLOCK_BEGIN}
HOST = os.environ.get("SPARK_HOST", "spark.local")  # the box
TOKEN = os.environ.get("SPARK_TOKEN")
PORT = 8012
{init.BLOCK_END}

print(HOST, TOKEN, PORT)
'''


def test_the_block_is_written_anew_and_nothing_else(tmp_path):
    text = init.written(BLOCK, {"HOST": "box"}, '"""A copy."""')
    assert text == (
        f'"""A copy."""\n\n{init.BLOCK_BEGIN}\nHOST = "box"  # the box\nTOKEN = None\nPORT = 8012\n'
        f"{init.BLOCK_END}\n\nprint(HOST, TOKEN, PORT)\n"
    )
    # os stays imported while a line outside the block reads it.
    kept = init.written(BLOCK.replace("print(", "print(os.sep, "), {}, '"""A copy."""')
    assert "import os\n" in kept


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (("PORT = 8012", "PORT = 8000 + 12"), "not 'PORT = 8000 + 12'"),
        (("PORT = 8012", "PORT: int = 8012"), "not 'PORT: int = 8012'"),
        (("PORT = 8012", "PORT = os.getenv('P', 1)"), "not \"PORT = os.getenv('P', 1)\""),
        ((init.BLOCK_END, ""), "mark one block"),
    ],
)
def test_a_block_of_another_shape_is_refused_naming_the_line(change, said):
    with pytest.raises(ValueError, match="block") as caught:
        init.written(BLOCK.replace(*change), {}, '"""A copy."""')
    assert said in str(caught.value)


def test_a_name_the_block_does_not_assign_is_refused():
    with pytest.raises(ValueError, match="assigns no USER"):
        init.written(BLOCK, {"USER": "ops"}, '"""A copy."""')
