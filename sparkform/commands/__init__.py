"""The commands of `sparkform`, one module each with its `add_parser` and its `run` (sparkform/cli.py
builds the command line from them). Those that connect reach a host over SSH (status, logs, bench,
contract, ledger, rollback, verify, the host's pins), the hub (pins), or run a tool here (lock: uv).
The pure core in sparkform/ builds what they send and reads what comes back; nothing there opens a
connection.
"""
