"""`sparkform bench --plot FILE.png`: the newest bench, alone against together per engine, beside
the ledger's history across dates. matplotlib is an optional extra: `pip install 'sparkform[plot]'`."""

from __future__ import annotations

from pathlib import Path

from sparkform.reports.bench import BenchError, BenchRow

WIDTH_IN, HEIGHT_IN, DPI = 11.0, 4.5, 100  # a 1100 x 450 pixel PNG


def plot(path: Path, host: str, rows: list[BenchRow]) -> None:
    """Write the PNG: bars of the newest row's decode tok/s (alone, together, with the delta),
    and each engine's alone and together figures over the ledger's dates."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install 'sparkform[plot]'") from None
    if not rows:
        raise BenchError(f"{host}: the ledger has no row to draw")
    latest = rows[-1]
    names = list(latest.engines)
    figure, (bars, history) = plt.subplots(1, 2, figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI)
    half = 0.38
    positions = range(len(names))
    alone = [latest.engines[n].alone_tok_s for n in names]
    together = [latest.engines[n].together_tok_s for n in names]
    bars.bar([p - half / 2 for p in positions], alone, half, label="alone (others idle)")
    drawn = bars.bar([p + half / 2 for p in positions], together, half, label="all generating")
    bars.bar_label(drawn, labels=[f"{(latest.engines[n].penalty - 1) * 100:+.0f}%" for n in names])
    bars.set_xticks(list(positions), names)
    bars.set_ylabel("decode tok/s")
    bars.set_title(f"{host}, {latest.date}")
    bars.legend()
    # One step per bench, labelled with its date: benches are days or weeks apart, a few a day.
    steps = list(range(len(rows)))
    for name in names:
        seen = [(step, row.engines[name]) for step, row in zip(steps, rows, strict=True) if name in row.engines]
        line = history.plot([s for s, _ in seen], [e.alone_tok_s for _, e in seen], marker="o", label=f"{name} alone")
        history.plot(
            [s for s, _ in seen],
            [e.together_tok_s for _, e in seen],
            marker="o",
            linestyle="--",
            color=line[0].get_color(),
            label=f"{name} together",
        )
    history.plot(steps, [row.combined_tok_s for row in rows], marker="s", color="black", label="combined")
    history.set_xticks(steps, [row.date.replace("T", " ").removesuffix("Z") for row in rows], rotation=30, ha="right")
    history.set_ylabel("decode tok/s")
    history.set_title(f"bench ledger: {len(rows)} bench{'es' if len(rows) != 1 else ''} (UTC)")
    history.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=DPI)
    plt.close(figure)
