"""A fake Hugging Face hub over HTTP, enough for `snapshot_download` and `hf download`.

huggingface_hub's downloads need four endpoints: the revision lookup
(/api/models/{repo}/revision/{rev}), the recursive tree listing (/api/models/{repo}/tree/{rev}),
and HEAD/GET of `/{repo}/resolve/{rev}/{path}`. This serves them from a HubStore's folder
(sparkform.sandbox.hubstore), so a sandbox can download real (tiny) checkpoints with the real
client and no network. Requests are recorded (method, path, status, and whether an Authorization
header came, never its value).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, BinaryIO, Self
from urllib.parse import parse_qs, unquote, urlsplit

from sparkform.sandbox.hubstore import CHUNK, HubError, HubStore, git_blob_sha1, publish_tiny_models


class FakeHub(HubStore):
    """A folder of repos served over HTTP the way huggingface.co serves them."""

    def __init__(self, root: Path, log_file: Path | None = None) -> None:
        super().__init__(root)
        self.log_file = log_file
        self._requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- request log -----------------------------------------------------------------------

    def record(self, entry: dict[str, Any]) -> None:
        """Keep one request's record in memory, and append it to the log file if there is one."""
        with self._lock:
            self._requests.append(entry)
            if self.log_file is not None:
                with open(self.log_file, "a") as log:
                    log.write(json.dumps(entry, sort_keys=True) + "\n")

    @property
    def requests(self) -> list[dict[str, Any]]:
        """A copy of every recorded request: {method, path, status, authorization, range, sent}."""
        with self._lock:
            return [dict(entry) for entry in self._requests]

    def clear_requests(self) -> None:
        """Forget the recorded requests (the log file keeps them)."""
        with self._lock:
            self._requests.clear()

    # --- serving ---------------------------------------------------------------------------

    def make_server(self, host: str, port: int) -> ThreadingHTTPServer:
        """A bound (not yet serving) HTTP server for this hub."""
        server = ThreadingHTTPServer((host, port), handler_for(self))
        server.daemon_threads = True
        self._server = server
        return server

    @property
    def url(self) -> str:
        """The endpoint to put in HF_ENDPOINT, e.g. http://127.0.0.1:41234."""
        if self._server is None:
            raise RuntimeError("the hub is not serving")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> None:
        """Serve in this thread until stop() (or a signal) ends it."""
        self.make_server(host, port).serve_forever()

    def start(self, host: str = "127.0.0.1", port: int = 0) -> Self:
        """Serve from a background thread; port 0 picks a free port (see `url`)."""
        server = self.make_server(host, port)
        self._thread = threading.Thread(target=server.serve_forever, name="fakehub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join()
        self._server = self._thread = None

    def __enter__(self) -> Self:
        return self if self._server else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- HTTP ---------------------------------------------------------------------------------------


def handler_for(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    """A request handler class bound to `hub`."""

    class Handler(HubHandler):
        pass

    Handler.hub = hub
    return Handler


class HubHandler(BaseHTTPRequestHandler):
    """Routes the hub's endpoints; every answer has a Content-Length (keep-alive for httpx)."""

    protocol_version = "HTTP/1.1"
    hub: FakeHub
    _status: int = 0
    _sent: int = 0

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: requests are recorded by the hub instead of printed."""

    def do_GET(self) -> None:  # http.server's naming
        self.handle_request(send_body=True)

    def do_HEAD(self) -> None:
        self.handle_request(send_body=False)

    def handle_request(self, send_body: bool) -> None:
        """Answer one request and record it, whatever happens."""
        self._status = 0  # one handler serves every request of a keep-alive connection
        self._sent = 0
        try:
            self.route(send_body)
        except HubError as err:
            self.send_error_answer(err, send_body)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away mid-body (an aborted download)
        finally:
            self.hub.record(
                {
                    "method": self.command,
                    "path": self.path,
                    "status": self._status,
                    "authorization": "Authorization" in self.headers,  # presence only, never the value
                    "range": self.headers.get("Range"),
                    "sent": self._sent,  # bytes of a file's body written to the client
                }
            )

    def route(self, send_body: bool) -> None:
        """Dispatch on the path (segments are split before unquoting: revisions may hold %2F)."""
        url = urlsplit(self.path)
        segments = [unquote(part) for part in url.path.strip("/").split("/")]
        query = {key: values[-1] for key, values in parse_qs(url.query).items()}
        if segments[:2] == ["api", "models"] and len(segments) >= 4:
            repo_id, rest = "/".join(segments[2:4]), segments[4:]
            if not rest:
                return self.send_json(self.repo_info(repo_id, "main"), send_body)
            if rest[0] == "revision" and len(rest) == 2:
                return self.send_json(self.repo_info(repo_id, rest[1]), send_body)
            if rest[0] == "tree" and len(rest) >= 2:
                recursive = query.get("recursive", "false").lower() == "true"
                return self.send_json(self.tree(repo_id, rest[1], "/".join(rest[2:]), recursive), send_body)
        if len(segments) >= 5 and segments[2] == "resolve":
            return self.send_file("/".join(segments[:2]), segments[3], "/".join(segments[4:]), send_body)
        raise HubError(404, None, f"Not found: {url.path}")

    # --- endpoints -------------------------------------------------------------------------

    def repo_info(self, repo_id: str, revision: str) -> dict[str, Any]:
        """/api/models/{id}/revision/{rev}: the id, the commit, and (for older clients) siblings."""
        commit = self.hub.resolve(repo_id, revision)
        siblings = [{"rfilename": path} for path in self.hub.files(repo_id, commit)]
        return {
            "id": repo_id,
            "modelId": repo_id,
            "sha": commit,
            "private": False,
            "gated": False,
            "disabled": False,
            "siblings": siblings,
        }

    def tree(self, repo_id: str, revision: str, folder: str, recursive: bool) -> list[dict[str, Any]]:
        """/api/models/{id}/tree/{rev}[/{path}]: files (and folders) under `folder`."""
        commit = self.hub.resolve(repo_id, revision)
        prefix = f"{folder.strip('/')}/" if folder.strip("/") else ""
        entries: dict[str, dict[str, Any]] = {}
        for path, meta in self.hub.files(repo_id, commit).items():
            if not path.startswith(prefix):
                continue
            below = path[len(prefix) :].split("/")
            # Folders on the way to the file: all of them when recursive, the first one otherwise.
            for depth in range(1, len(below) if recursive else min(len(below), 2)):
                folder_path = prefix + "/".join(below[:depth])
                # A stand-in oid: clients only use directory entries to tell them from files.
                entries.setdefault(
                    folder_path,
                    {"type": "directory", "path": folder_path, "size": 0, "oid": git_blob_sha1(folder_path.encode())},
                )
            if recursive or len(below) == 1:
                entries[path] = meta.tree_entry()
        if recursive or not prefix:  # a hostile mirror's entries (HubStore.list_only), as they are
            entries.update((meta.path, meta.tree_entry()) for meta in self.hub.listed_only(repo_id, commit))
        if prefix and not entries:
            raise HubError(404, "EntryNotFound", f"{folder} does not exist on {revision}")
        return [entries[path] for path in sorted(entries)]

    def send_file(self, repo_id: str, revision: str, path: str, send_body: bool) -> None:
        """HEAD/GET /{id}/resolve/{rev}/{path}, with single byte ranges (206) for resumes."""
        commit = self.hub.resolve(repo_id, revision)
        meta = self.hub.files(repo_id, commit).get(path)
        if meta is None:
            raise HubError(404, "EntryNotFound", f"{path} does not exist on {revision}")
        headers = {
            "X-Repo-Commit": commit,
            "ETag": meta.etag,
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        try:
            span = byte_range(self.headers.get("Range"), meta.size)
        except HubError as err:
            headers["Content-Range"] = f"bytes */{meta.size}"
            return self.send_answer(err.status, headers, b"", send_body)
        first, last = span or (0, meta.size - 1)
        if span:
            headers["Content-Range"] = f"bytes {first}-{last}/{meta.size}"
        self.send_head(206 if span else 200, headers, last - first + 1)
        if send_body:
            flip_at = meta.size // 2 if f"{commit}/{path}" in self.hub.corrupted(repo_id) else None
            cut_after = self.hub.take_cut(path)
            if cut_after is not None:
                last = min(last, first + cut_after - 1)
                self.close_connection = True  # short of its Content-Length: the client sees a cut
            with (self.hub.repo_dir(repo_id) / commit / path).open("rb") as handle:
                for index, chunk in enumerate(body_chunks(handle, first, last, flip_at)):
                    if index == 1:
                        self.hub.wait_while_stalled()
                    self.wfile.write(chunk)
                    self._sent += len(chunk)

    # --- answers ---------------------------------------------------------------------------

    def send_head(self, status: int, headers: dict[str, str], length: int) -> None:
        """Status line and headers, Content-Length included."""
        self._status = status
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(length))
        self.end_headers()

    def send_answer(self, status: int, headers: dict[str, str], body: bytes, send_body: bool) -> None:
        """A whole answer with a small in-memory body."""
        self.send_head(status, headers, len(body))
        if send_body:
            self.wfile.write(body)

    def send_json(self, data: Any, send_body: bool) -> None:
        """200 with a JSON body."""
        self.send_answer(200, {"Content-Type": "application/json"}, json.dumps(data).encode(), send_body)

    def send_error_answer(self, err: HubError, send_body: bool) -> None:
        """An error the way the hub sends it: X-Error-Code/X-Error-Message and {"error": ...}."""
        headers = {"Content-Type": "application/json", "X-Error-Message": err.message}
        if err.code:
            headers["X-Error-Code"] = err.code
        body = json.dumps({"error": err.message}).encode()
        self.send_answer(err.status, headers, body, send_body)


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(first, last) of a single `bytes=` Range header, None for no (or a multi-) range.
    Raises HubError 416 for a range that starts past the end."""
    if not header or not header.startswith("bytes=") or "," in header:
        return None
    first_text, _, last_text = header[len("bytes=") :].strip().partition("-")
    try:
        if first_text == "":  # a suffix range: the last N bytes
            first, last = max(size - int(last_text), 0), size - 1
        else:
            first = int(first_text)
            last = min(int(last_text), size - 1) if last_text else size - 1
    except ValueError:
        return None
    if first >= size or first > last:
        raise HubError(416, None, f"Range {header!r} not satisfiable for {size} bytes")
    return first, last


def body_chunks(handle: BinaryIO, first: int, last: int, flip_at: int | None) -> Iterator[bytes]:
    """Bytes first..last of `handle`, with the byte at `flip_at` inverted (a corrupted file)."""
    handle.seek(first)
    position = first
    while position <= last:
        chunk = handle.read(min(CHUNK, last - position + 1))
        if not chunk:
            return
        if flip_at is not None and position <= flip_at < position + len(chunk):
            damaged = bytearray(chunk)
            damaged[flip_at - position] ^= 0xFF
            chunk = bytes(damaged)
        yield chunk
        position += len(chunk)


# --- running as a process -------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """`python -m sparkform.sandbox.fakehub --root DIR [--host H] [--port P] [--log FILE]`."""
    parser = argparse.ArgumentParser(description="Serve the tiny test checkpoints as a fake Hugging Face hub.")
    parser.add_argument("--root", type=Path, required=True, help="folder of the hub's repos")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    parser.add_argument("--log", type=Path, help="append one JSON line per request here")
    args = parser.parse_args(argv)

    hub = FakeHub(args.root, log_file=args.log)
    commits = publish_tiny_models(hub)
    server = hub.make_server(args.host, args.port)
    # SIGTERM (systemd, a test's terminate()) ends serve_forever like Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    print(f"fakehub: serving {hub.url}", flush=True)
    for repo_id, commit in commits.items():
        print(f"fakehub: {repo_id}@{commit}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    print("fakehub: stopped", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
