"""`sparkform bench`'s tables: one bench's figures per engine, and a host's history of them with
the change from one row to the next."""

from __future__ import annotations

from sparkform.reports.bench import BenchRow

# --- the table ------------------------------------------------------------------------------------


def _delta(ratio: float) -> str:
    """-64%, +3%, as the field notes' delta column (ratio 0.36 -> -64%)."""
    return f"{(ratio - 1) * 100:+.0f}%"


def _columns(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def format_row(host: str, row: BenchRow) -> str:
    """The bench as the field notes' co-residency table, its settings and the combined figure."""
    table: list[tuple[str, ...]] = [
        ("engine", "alone (others idle)", "all generating", "together/alone", "delta", "TTFT alone", "TTFT together")
    ]
    for name, e in row.engines.items():
        table.append(
            (
                name,
                f"{e.alone_tok_s:.1f} tok/s",
                f"{e.together_tok_s:.1f} tok/s",
                f"{e.penalty:.2f}",
                _delta(e.penalty),
                f"{e.alone_ttft_ms:.0f} ms",
                f"{e.together_ttft_ms:.0f} ms",
            )
        )
    fastest, fastest_tok_s = row.fastest_alone()
    combined = row.combined_tok_s
    ratio = combined / fastest_tok_s if fastest_tok_s else 0.0
    shared = ", ".join(f"{name} {e.together_overlap:.0%}" for name, e in row.engines.items())
    return "\n".join(
        [
            f"{host}: co-residency, {row.vllm}, {row.date}",
            f"settings: {row.settings.describe(len(row.engines))}",
            _columns(table),
            f"combined: {combined:.1f} tok/s with all generating, against {fastest_tok_s:.1f} tok/s for {fastest} "
            f"alone (together / alone {ratio:.2f}, {_delta(ratio)})",
            f"share of each together run the others were generating too: {shared}",
        ]
    )


def format_history(host: str, rows: list[BenchRow]) -> str:
    """Every bench of the ledger, one line per bench and engine."""
    table: list[tuple[str, ...]] = [("date", "vllm", "engine", "alone tok/s", "together tok/s", "delta", "combined")]
    for row in rows:
        for name, e in row.engines.items():
            table.append(
                (
                    row.date,
                    row.vllm,
                    name,
                    f"{e.alone_tok_s:.1f}",
                    f"{e.together_tok_s:.1f}",
                    _delta(e.penalty),
                    f"{row.combined_tok_s:.1f}",
                )
            )
    return f"{host}: bench ledger, {len(rows)} bench{'es' if len(rows) != 1 else ''}\n{_columns(table)}"
