"""A fake Hugging Face hub over HTTP, enough for `snapshot_download` and `hf download`.

huggingface_hub's downloads need four endpoints (REFERENCE §2): the revision lookup, the
recursive tree listing, and HEAD/GET of `/{repo}/resolve/{rev}/{path}`. This serves them from a
folder, so a sandbox can download real (tiny) checkpoints with the real client and no network:

    <root>/<owner>/<name>/<commit>/<files...>     one folder per commit, never changed
    <root>/<owner>/<name>/refs/<branch>           the commit a branch points at
    <root>/<owner>/<name>/corrupted.json          "<commit>/<path>" entries served corrupted
    <root>/stall                                  while it exists, file bodies pause mid-way

Every lookup reads the folder, so another process (a test) can move a branch or corrupt a file
while the server runs. Commit ids are 40 hex digits derived from the repo id and the files'
content, so the same content always gets the same commit. Requests are recorded (method, path,
status, and whether an Authorization header came, never its value).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, BinaryIO, Self
from urllib.parse import parse_qs, unquote, urlsplit

from sparkform.sandbox.models import TINY_MODELS, cached_checkpoint

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".onnx", ".msgpack", ".h5")
LFS_MIN_SIZE = 10 * 1024 * 1024  # the hub's .gitattributes also send any file over 10 MB to LFS
CHUNK = 1024 * 1024
COMMIT_HEX = frozenset("0123456789abcdef")


class HubError(Exception):
    """An HTTP error the hub answers with, carrying the hub's X-Error-Code."""

    def __init__(self, status: int, code: str | None, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


@dataclass(frozen=True)
class FileMeta:
    """What the hub says about one file of one commit."""

    path: str
    size: int
    sha256: str
    blob_oid: str  # git's blob sha1 of the file, or of its LFS pointer
    lfs_pointer_size: int | None  # None: a regular git file

    def tree_entry(self) -> dict[str, Any]:
        """The file's entry in /api/models/{id}/tree/{rev}."""
        entry: dict[str, Any] = {"type": "file", "path": self.path, "size": self.size, "oid": self.blob_oid}
        if self.lfs_pointer_size is not None:
            entry["lfs"] = {"oid": self.sha256, "size": self.size, "pointerSize": self.lfs_pointer_size}
        return entry

    @property
    def etag(self) -> str:
        """Quoted sha256 for LFS files (as the hub's X-Linked-Etag), the blob sha1 otherwise."""
        return f'"{self.sha256 if self.lfs_pointer_size is not None else self.blob_oid}"'


def git_blob_sha1(data: bytes) -> str:
    """git's object id of a blob with `data`."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    """The git-lfs pointer file that git stores in place of a large file."""
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def file_sha256(path: Path) -> str:
    """sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def describe_file(path: Path, rel_path: str) -> FileMeta:
    """FileMeta of one file; weights and files over 10 MB are LFS files, like on the hub."""
    size = path.stat().st_size
    sha256 = file_sha256(path)
    if rel_path.endswith(LFS_SUFFIXES) or size >= LFS_MIN_SIZE:
        pointer = lfs_pointer(sha256, size)
        return FileMeta(rel_path, size, sha256, git_blob_sha1(pointer), len(pointer))
    return FileMeta(rel_path, size, sha256, git_blob_sha1(path.read_bytes()), None)


def repo_files(folder: Path) -> list[str]:
    """Relative paths of every file under `folder`, sorted, with '/' separators."""
    return sorted(path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file())


def content_commit(repo_id: str, folder: Path) -> str:
    """A 40-hex commit id from the repo id and every file's path and sha256."""
    digest = hashlib.sha1(f"sparkform-fakehub {repo_id}\n".encode())
    for rel_path in repo_files(folder):
        digest.update(f"{rel_path} {file_sha256(folder / rel_path)}\n".encode())
    return digest.hexdigest()


def is_commit_id(revision: str) -> bool:
    """True for a full 40-hex commit id (which the hub resolves without refs)."""
    return len(revision) == 40 and set(revision) <= COMMIT_HEX


def split_repo_id(repo_id: str) -> tuple[str, str]:
    """('owner', 'name') of 'owner/name'; anything else is not a repo id this hub can hold."""
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(parts) or any(part in (".", "..") for part in parts):
        raise HubError(404, "RepoNotFound", f"Repository {repo_id!r} not found")
    return parts[0], parts[1]


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(first, last) of a single `bytes=` Range header, None for no (or a multi-) range.
    Raises HubError 416 for a range that starts past the end."""
    if not header or not header.startswith("bytes=") or "," in header:
        return None
    first_text, _, last_text = header[len("bytes="):].strip().partition("-")
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


class FakeHub:
    """A folder of repos served over HTTP the way huggingface.co serves them."""

    def __init__(self, root: Path, log_file: Path | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.log_file = log_file
        self._requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._meta_cache: dict[tuple[str, str], dict[str, FileMeta]] = {}  # commits never change
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- repos on disk ----------------------------------------------------------------------

    def repo_dir(self, repo_id: str) -> Path:
        """The folder of `repo_id` (which may not exist)."""
        owner, name = split_repo_id(repo_id)
        return self.root / owner / name

    def add_repo(self, repo_id: str, files_dir: Path, branch: str = "main") -> str:
        """Store the files of `files_dir` as a commit of `repo_id` and point `branch` at it
        (creating the repo, or moving the branch). Returns the commit id."""
        commit = content_commit(repo_id, Path(files_dir))
        target = self.repo_dir(repo_id) / commit
        if not target.is_dir():
            target.parent.mkdir(parents=True, exist_ok=True)
            # Copy beside the target and rename: a half-copied commit is never served.
            staging = Path(tempfile.mkdtemp(prefix=".commit-", dir=target.parent))
            shutil.copytree(files_dir, staging, dirs_exist_ok=True)
            staging.rename(target)
        self.move_branch(repo_id, branch, commit)
        return commit

    def move_branch(self, repo_id: str, branch: str, commit: str) -> None:
        """Point `branch` of `repo_id` at `commit` (an existing commit of the repo)."""
        if not (self.repo_dir(repo_id) / commit).is_dir():
            raise ValueError(f"{repo_id} has no commit {commit}")
        ref = self.repo_dir(repo_id) / "refs" / branch
        ref.parent.mkdir(parents=True, exist_ok=True)
        partial = ref.with_name(ref.name + ".partial")
        partial.write_text(commit + "\n")
        partial.replace(ref)  # atomic: a reader sees the old commit or the new one

    def resolve(self, repo_id: str, revision: str) -> str:
        """The commit id that `revision` (a branch or a commit id) names in `repo_id`."""
        repo = self.repo_dir(repo_id)
        if not repo.is_dir():
            raise HubError(404, "RepoNotFound", f"Repository {repo_id!r} not found")
        if is_commit_id(revision) and (repo / revision).is_dir():
            return revision
        refs = repo / "refs"
        ref = refs / revision
        # A revision comes from the URL: it must not reach outside refs/ (`..`, a leading `/`).
        if ref.resolve().is_relative_to(refs.resolve()) and ref.is_file():
            return ref.read_text().strip()
        raise HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")

    def files(self, repo_id: str, commit: str) -> dict[str, FileMeta]:
        """Every file of one commit, by path (computed once: commits never change)."""
        key = (repo_id, commit)
        if key not in self._meta_cache:
            folder = self.repo_dir(repo_id) / commit
            self._meta_cache[key] = {path: describe_file(folder / path, path) for path in repo_files(folder)}
        return self._meta_cache[key]

    def stall(self, stalled: bool = True) -> None:
        """Make downloads hang after their first chunk until `stall(False)`: a download that
        is in flight long enough for a test to cut it."""
        flag = self.root / "stall"
        if stalled:
            flag.touch()
        else:
            flag.unlink(missing_ok=True)

    def wait_while_stalled(self, poll_s: float = 0.1) -> None:
        while (self.root / "stall").exists():
            time.sleep(poll_s)

    def _corrupted_list(self, repo_id: str) -> Path:
        """The file that lists the corrupted entries of `repo_id`."""
        return self.repo_dir(repo_id) / "corrupted.json"

    def corrupted(self, repo_id: str) -> set[str]:
        """The "<commit>/<path>" entries of `repo_id` that are served corrupted."""
        listing = self._corrupted_list(repo_id)
        return set(json.loads(listing.read_text())) if listing.is_file() else set()

    def corrupt_file(self, repo_id: str, path: str, revision: str = "main", corrupt: bool = True) -> None:
        """Serve `path` of `revision` with one byte flipped (or, corrupt=False, intact again).
        Size, ETag and the tree's sha256 stay those of the real file: the client's size check
        passes, and only a sha256 check against the tree can catch it."""
        commit = self.resolve(repo_id, revision)
        if path not in self.files(repo_id, commit):
            raise ValueError(f"{repo_id}@{commit} has no file {path}")
        entries = self.corrupted(repo_id)
        entries = entries | {f"{commit}/{path}"} if corrupt else entries - {f"{commit}/{path}"}
        partial = self._corrupted_list(repo_id).with_suffix(".partial")
        partial.write_text(json.dumps(sorted(entries)) + "\n")
        partial.replace(self._corrupted_list(repo_id))

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
        """A copy of every recorded request: {method, path, status, authorization, range}."""
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
        return f"http://{host}:{port}"

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

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: requests are recorded by the hub instead of printed."""

    def do_GET(self) -> None:  # http.server's naming
        self.handle_request(send_body=True)

    def do_HEAD(self) -> None:
        self.handle_request(send_body=False)

    def handle_request(self, send_body: bool) -> None:
        """Answer one request and record it, whatever happens."""
        self._status = 0  # one handler serves every request of a keep-alive connection
        try:
            self.route(send_body)
        except HubError as err:
            self.send_error_answer(err, send_body)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away mid-body (an aborted download)
        finally:
            self.hub.record({
                "method": self.command,
                "path": self.path,
                "status": self._status,
                "authorization": "Authorization" in self.headers,  # presence only, never the value
                "range": self.headers.get("Range"),
            })

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
        return {"id": repo_id, "modelId": repo_id, "sha": commit, "private": False, "gated": False,
                "disabled": False, "siblings": siblings}

    def tree(self, repo_id: str, revision: str, folder: str, recursive: bool) -> list[dict[str, Any]]:
        """/api/models/{id}/tree/{rev}[/{path}]: files (and folders) under `folder`."""
        commit = self.hub.resolve(repo_id, revision)
        prefix = f"{folder.strip('/')}/" if folder.strip("/") else ""
        entries: dict[str, dict[str, Any]] = {}
        for path, meta in self.hub.files(repo_id, commit).items():
            if not path.startswith(prefix):
                continue
            below = path[len(prefix):].split("/")
            # Folders on the way to the file: all of them when recursive, the first one otherwise.
            for depth in range(1, len(below) if recursive else min(len(below), 2)):
                folder_path = prefix + "/".join(below[:depth])
                # A stand-in oid: clients only use directory entries to tell them from files.
                entries.setdefault(folder_path, {"type": "directory", "path": folder_path, "size": 0,
                                                 "oid": git_blob_sha1(folder_path.encode())})
            if recursive or len(below) == 1:
                entries[path] = meta.tree_entry()
        if prefix and not entries:
            raise HubError(404, "EntryNotFound", f"{folder} does not exist on {revision}")
        return [entries[path] for path in sorted(entries)]

    def send_file(self, repo_id: str, revision: str, path: str, send_body: bool) -> None:
        """HEAD/GET /{id}/resolve/{rev}/{path}, with single byte ranges (206) for resumes."""
        commit = self.hub.resolve(repo_id, revision)
        meta = self.hub.files(repo_id, commit).get(path)
        if meta is None:
            raise HubError(404, "EntryNotFound", f"{path} does not exist on {revision}")
        headers = {"X-Repo-Commit": commit, "ETag": meta.etag, "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
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
            with (self.hub.repo_dir(repo_id) / commit / path).open("rb") as handle:
                for index, chunk in enumerate(body_chunks(handle, first, last, flip_at)):
                    if index == 1:
                        self.hub.wait_while_stalled()
                    self.wfile.write(chunk)

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

def publish_tiny_models(hub: FakeHub) -> dict[str, str]:
    """Build (or reuse, by content) every TINY_MODELS checkpoint and add it to `hub`.
    Returns {repo_id: commit}."""
    build_cache = hub.root / ".build"  # a dot folder: never taken for an owner
    return {repo_id: hub.add_repo(repo_id, cached_checkpoint(kind, build_cache))
            for repo_id, kind in TINY_MODELS.items()}


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
