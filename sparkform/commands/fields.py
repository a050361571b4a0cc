"""`sparkform fields`: the table of inventory fields (docs/fields.md), made from the schema's own
descriptions; it never connects.

Exit code: 0.
"""

from __future__ import annotations

import argparse
import json

from pydantic import BaseModel

from sparkform.domain.engine import Checkpoint, Engine, Measured
from sparkform.domain.schema import CompileCaps, FrontTLS, HostConfig, Monitoring, Scrub


def field_table() -> str:
    """The table of inventory fields in docs/fields.md, from the schema's own descriptions."""
    sections: list[tuple[str, type[BaseModel]]] = [
        ("host", HostConfig),
        ("compile_caps.", CompileCaps),
        ("front_tls.", FrontTLS),
        ("monitoring.", Monitoring),
        ("scrub.", Scrub),
        ("engines[].", Engine),
        ("engines[].checkpoint.", Checkpoint),
        ("engines[].measured.", Measured),
    ]
    lines = ["| field | default | meaning |", "|---|---|---|"]
    for prefix, model in sections:
        for name, info in model.model_fields.items():
            if info.is_required():
                default = "required"
            else:
                value = info.get_default(call_default_factory=True)
                tables = (CompileCaps, FrontTLS, Measured, Monitoring, Scrub)
                default = "—" if isinstance(value, tables) else f"`{json.dumps(value)}`"
            label = name if prefix == "host" else f"{prefix}{name}"
            if not info.description:
                raise ValueError(f"{label} has no description: a field's docstring in the schema is its docs")
            meaning = " ".join(info.description.split())  # the field's docstring, on one line
            lines.append(f"| `{label}` | {default} | {meaning} |")
    return "\n".join(lines)


def run(_: argparse.Namespace) -> int:
    print(field_table())
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    fields = sub.add_parser("fields", help="print the inventory field table (Markdown)")
    fields.set_defaults(run=run)
