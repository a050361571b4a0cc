"""The README's field table is the schema's: a field added without docs fails here."""

from pathlib import Path

from sparkform.cli import field_table

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_field_table_matches_schema():
    assert field_table() in README.read_text(), "regenerate the table with `sparkform fields`"


def test_every_field_has_a_description():
    for line in field_table().splitlines()[2:]:
        assert not line.endswith("| None |"), line
