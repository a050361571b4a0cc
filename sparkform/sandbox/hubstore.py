"""The fake Hugging Face hub's repositories on disk: commits, branches, and each file as the hub
describes it (size, sha256, git blob id, LFS pointer), plus the switches a test flips while the
hub serves (a corrupted file, stalled downloads, a cut download). sparkform.sandbox.fakehub serves a
store over HTTP.

    <root>/<owner>/<name>/<commit>/<files...>     one folder per commit, never changed
    <root>/<owner>/<name>/refs/<branch>           the commit a branch points at
    <root>/<owner>/<name>/corrupted.json          "<commit>/<path>" entries served corrupted
    <root>/stall                                  while it exists, file bodies pause mid-way
    <root>/cut.json                               {"path", "after"}: the next body of that file
                                                  stops after that many bytes (once)

Every lookup reads the folder, so another process (a test) can move a branch or corrupt a file
while the server runs. Commit ids are 40 hex digits derived from the repo id and the files'
content, so the same content always gets the same commit.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

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


class HubStore:
    """A folder of repos, read and changed the way the hub's endpoints and a test need."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._meta_cache: dict[tuple[str, str], dict[str, FileMeta]] = {}  # commits never change

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

    def cut(self, path: str, after: int) -> None:
        """Cut the next download of `path` (any repo) after `after` bytes of its body: the
        connection closes short of the Content-Length it announced, as a dropped link does. Once."""
        partial = self.root / "cut.json.partial"
        partial.write_text(json.dumps({"path": path, "after": after}) + "\n")
        partial.replace(self.root / "cut.json")

    def take_cut(self, path: str) -> int | None:
        """The bytes after which this body of `path` stops, if a cut waits for it (then spent)."""
        flag = self.root / "cut.json"
        try:
            cut = json.loads(flag.read_text())
        except FileNotFoundError:
            return None
        if cut["path"] != path:
            return None
        try:
            flag.unlink()  # one body only: whoever unlinks it takes it
        except FileNotFoundError:
            return None
        return int(cut["after"])

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

    def _listed_only(self, repo_id: str) -> Path:
        return self.repo_dir(repo_id) / "listed-only.json"

    def list_only(self, repo_id: str, path: str, like: str, revision: str = "main") -> None:
        """A hostile mirror's tree: list `path` ('../escape', '/etc/x', anything) in `revision`
        with the size and hashes of its file `like`. Only the listing carries it; no file is
        served under that path."""
        commit = self.resolve(repo_id, revision)
        if like not in self.files(repo_id, commit):
            raise ValueError(f"{repo_id}@{commit} has no file {like}")
        listing = self._listed_only(repo_id)
        entries = json.loads(listing.read_text()) if listing.is_file() else []
        entries.append({"commit": commit, "path": path, "like": like})
        listing.write_text(json.dumps(entries) + "\n")

    def listed_only(self, repo_id: str, commit: str) -> list[FileMeta]:
        """The entries `list_only` added to `commit`'s tree."""
        listing = self._listed_only(repo_id)
        entries = json.loads(listing.read_text()) if listing.is_file() else []
        files = self.files(repo_id, commit)
        return [replace(files[e["like"]], path=e["path"]) for e in entries if e["commit"] == commit]


def publish_tiny_models(store: HubStore) -> dict[str, str]:
    """Build (or reuse, by content) every TINY_MODELS checkpoint and add it to `store`.
    Returns {repo_id: commit}."""
    build_cache = store.root / ".build"  # a dot folder: never taken for an owner
    return {
        repo_id: store.add_repo(repo_id, cached_checkpoint(kind, build_cache)) for repo_id, kind in TINY_MODELS.items()
    }
