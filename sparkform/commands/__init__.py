"""The commands that connect: each reaches a host over SSH (status, logs, bench, contract, ledger,
rollback, the host's pins), the hub (pins), or runs a tool here (lock: uv). The pure core in
sparkform/ builds what they send and reads what comes back; nothing there opens a connection.
"""
