"""The sandbox's alert receiver: a webhook on this machine's side of the sandbox's link that
appends every JSON body POSTed to it to a file, one line each, for the tests to read.

    python -m sparkform.sandbox.alerts --host H --port P --out FILE
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

MAX_BODY = 2**20


def read_alerts(path: Path) -> list[dict]:
    """Every alert received so far, oldest first."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def make_server(host: str, port: int, out: Path) -> ThreadingHTTPServer:
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format, *args):  # recorded in `out` instead
            pass

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(min(length, MAX_BODY))
            try:
                alert = json.loads(body)
            except ValueError:
                alert = {"unparsed": body.decode("utf-8", "replace")}
            with lock, out.open("a") as handle:
                handle.write(json.dumps({"path": self.path, "alert": alert}) + "\n")
            self.send_response(204)
            self.end_headers()

    return ThreadingHTTPServer((host, port), Handler)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Record the alerts a sandbox sends to its webhook.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True, help="append one JSON line per alert here")
    args = parser.parse_args(argv)
    server = make_server(args.host, args.port, args.out)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    try:
        server.serve_forever()
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
