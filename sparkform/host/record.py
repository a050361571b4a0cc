"""sparkform-record [--textfile PROM] RECORD_FILE RECORD_JSON [ENGINE=UNIT[:cold]]...: write the
host record at the end of a successful converge (and, with --textfile, its metrics for
node_exporter's textfile collector). RECORD_JSON is the record as the deploy planned it (versions,
cache keys, times it already knew); each ENGINE=UNIT the converge started gets the seconds
systemd measured from its start to active (readiness), and `:cold` marks a start that rebuilt
its JIT caches, so the next drift report can say how long a rebuild takes on this host.
PROM gets the record as sparkform_* metrics: the versions (an info metric), each engine's cache
key and measured starts, and when the record was written.

Exit codes:
  0  written (root's, 0644, replaced atomically by a rename, never through a link)
  2  usage
  3  a named unit is not active: there is no start to measure
  4  the record is written, its metrics are not (PROM's folder is not root's alone)
"""

import json
import subprocess
import sys
import time

from sparkform.host.textfile import metric_family, write_textfile
from sparkform.host.whole_files import replaced

PROPERTIES = "ExecMainStartTimestamp,ExecMainStartTimestampMonotonic,ActiveEnterTimestampMonotonic,ActiveState"


def measured_start(unit: str) -> tuple[float, float]:
    """(unix time the main process started, seconds from then to active)."""
    out = subprocess.run(
        ["systemctl", "show", "--timestamp=unix", "-p", PROPERTIES, unit], capture_output=True, text=True, check=True
    ).stdout
    props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    started = int(props.get("ExecMainStartTimestampMonotonic") or 0)
    active = int(props.get("ActiveEnterTimestampMonotonic") or 0)
    if props.get("ActiveState") != "active" or not active > started > 0:
        print(f"sparkform-record: {unit} is {props.get('ActiveState')}: no start to measure", file=sys.stderr)
        sys.exit(3)
    return float(props["ExecMainStartTimestamp"].lstrip("@")), round((active - started) / 1e6, 1)


def record_metrics(record: dict, written_at: float) -> str:
    """The record as metrics, in Prometheus' text format."""
    engines = sorted(record["engines"].items())

    def per_engine(key):
        return [({"engine": name}, entry[key]) for name, entry in engines if entry.get(key) is not None]

    return "".join(
        [
            metric_family(
                "sparkform_host_info",
                "gauge",
                "What the last converge found on the host (the host record's versions; empty: not reported).",
                [({name: value or "" for name, value in record["versions"].items()}, 1)],
            ),
            metric_family(
                "sparkform_converge_timestamp_seconds",
                "gauge",
                "When a converge last wrote the host record "
                "(one that started an engine or found other versions; a no-op converge writes nothing).",
                [({}, written_at)],
            ),
            metric_family(
                "sparkform_engine_cache_key_info",
                "gauge",
                "The key the engine's JIT caches were built under.",
                [({"engine": name, "cache_key": entry["cache_key"]}, 1) for name, entry in engines],
            ),
            metric_family(
                "sparkform_engine_cold_start_seconds",
                "gauge",
                "The engine's last cold start (JIT caches rebuilt), from start to serving.",
                per_engine("cold_start_s"),
            ),
            metric_family(
                "sparkform_engine_start_seconds",
                "gauge",
                "The engine's last recorded start, from start to serving.",
                per_engine("start_s"),
            ),
            metric_family(
                "sparkform_engine_started_timestamp_seconds",
                "gauge",
                "When that start began.",
                per_engine("started_at"),
            ),
        ]
    )


def main() -> None:
    args = sys.argv[1:]
    textfile = None
    if args[:1] == ["--textfile"] and len(args) > 1:
        textfile, args = args[1], args[2:]
    if len(args) < 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        sys.exit(2)
    path, record = args[0], json.loads(args[1])
    for arg in args[2:]:
        engine, _, unit = arg.partition("=")
        unit, _, kind = unit.partition(":")
        entry = record["engines"][engine]
        entry["started_at"], entry["start_s"] = measured_start(unit)
        entry["last_start_cold"] = kind == "cold"
        if kind == "cold":
            entry["cold_start_s"] = entry["start_s"]
    replaced(path, json.dumps(record, sort_keys=True, indent=2) + "\n", 0o644)
    if textfile:
        try:
            write_textfile(textfile, record_metrics(record, time.time()))
        except OSError as err:
            print(f"sparkform-record: {err}", file=sys.stderr)
            sys.exit(4)


if __name__ == "__main__":
    main()
