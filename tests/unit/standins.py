"""The stand-ins the unit tests put where a host's own programs and engines would be.

recording_command writes a command (systemctl, journalctl, systemd-run, any name) onto a folder
the test puts first on PATH: each call appends its argv to a calls file, then the command answers
as the test says. StubEngine is an HTTP server on 127.0.0.1 whose answers the test hands it; it
records every request, and a request answered with HANG waits until the server is closed.
"""

from __future__ import annotations

import json
import shlex
import socketserver
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypedDict

# What each kind's probe route answers, as vLLM does (the probes check the list is not empty).
PROBE_ANSWERS: dict[str, Any] = {
    "/v1/completions": {"choices": [{"text": "pong"}]},
    "/v1/embeddings": {"data": [{"object": "embedding", "embedding": [0.1, 0.2], "index": 0}]},
    "/rerank": {"results": [{"index": 0, "relevance_score": 0.5}]},
}


def recording_command(folder: Path, name: str, calls: Path, answer: str = "") -> Path:
    """Write the executable `folder/name`: each call appends the line "name ARGS" to `calls`, exits 1
    when its arguments are those in $STUB_FAILS (a failure the test switches on per run), and
    otherwise runs `answer`, the sh lines that print its canned output or choose its exit status."""
    folder.mkdir(parents=True, exist_ok=True)
    command = folder / name
    command.write_text(
        "#!/bin/sh\n"
        f'printf "%s\\n" "{name} $*" >> {shlex.quote(str(calls))}\n'
        'if [ -n "${STUB_FAILS:-}" ] && [ "$*" = "$STUB_FAILS" ]; then exit 1; fi\n'
        f"{answer}\n"
    )
    command.chmod(0o755)
    return command


class Request(TypedDict):
    """One request a StubEngine received (a dict, as the tests index it)."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass(frozen=True)
class Reply:
    """What a StubEngine answers: a body sent whole, or `events` sent chunked as they are made."""

    status: int = 200
    body: bytes = b"{}"
    content_type: str = "application/json"
    events: Iterable[bytes] | None = None


def json_reply(value: Any, status: int = 200, compact: bool = False) -> Reply:
    return Reply(status, json.dumps(value, separators=(",", ":") if compact else None).encode())


NOT_FOUND = json_reply({"detail": "Not Found"}, 404)
HANG = Reply(status=0)  # no answer at all: the request waits until the server closes


class _UnixServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True  # a request left hanging never holds close()
    # A unix socket refuses a connection at once when its backlog is full (TCP retries): the
    # front's workers open several at a time, more than socketserver's default of 5.
    request_queue_size = 128


class StubEngine:
    """An HTTP server that answers each request with what `answer` returns for it; `requests`
    lists every request in the order they came. On the unix socket `path` where given (as an
    engine serves; its folder made if missing), else on 127.0.0.1 (`port`, or a free one)."""

    def __init__(self, answer: Callable[[Request], Reply], port: int = 0, path: str | Path | None = None):
        self.answer = answer
        self.requests: list[Request] = []
        self.closing = threading.Event()
        self.socket = None if path is None else Path(path)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def address_string(self) -> str:  # a unix socket's peer has no address
                return str(outer.socket) if outer.socket else super().address_string()

            def log_message(self, *args: Any) -> None:  # keep pytest's output clean
                pass

            def _handle(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                request = Request(method=self.command, path=self.path, headers=dict(self.headers), body=body)
                outer.requests.append(request)
                reply = outer.answer(request)
                if reply is HANG:
                    outer.closing.wait()
                    self.close_connection = True
                    return
                self.send_response(reply.status)
                self.send_header("Content-Type", reply.content_type)
                if reply.events is None:
                    self.send_header("Content-Length", str(len(reply.body)))
                    self.end_headers()
                    self.wfile.write(reply.body)
                    return
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for event in reply.events:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

            do_GET = do_POST = _handle

        if self.socket is None:
            self.server: socketserver.BaseServer = ThreadingHTTPServer(("127.0.0.1", port), Handler)
            self.port = self.server.server_address[1]
        else:
            self.socket.parent.mkdir(parents=True, exist_ok=True)  # as systemd-tmpfiles makes it
            self.server, self.port = _UnixServer(str(self.socket), Handler), port
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def paths(self, method: str | None = None) -> list[str]:
        """The paths asked for, in order (only those of `method` when named)."""
        return [r["path"] for r in self.requests if method is None or r["method"] == method]

    def close(self) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()
        if self.socket:
            self.socket.unlink(missing_ok=True)
