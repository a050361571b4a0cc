"""The field table of docs/fields.md is the schema's: a field added without docs fails here."""

from pathlib import Path

from sparkform.cli import field_table

FIELDS = Path(__file__).resolve().parents[2] / "docs" / "fields.md"


def test_docs_field_table_matches_schema():
    assert field_table() in FIELDS.read_text(), "regenerate the table in docs/fields.md with `sparkform fields`"


def test_every_field_has_a_description():
    for line in field_table().splitlines()[2:]:
        assert not line.endswith("| None |"), line
