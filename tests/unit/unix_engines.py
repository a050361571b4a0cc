"""What stand-ins on unix sockets need, where an engine serves its own API (vLLM's --uds; a
standins.StubEngine with `path`): short folders for them, and raw_answer_once, which sends one
request's answer byte for byte, however malformed.

A socket's path must fit the kernel's bound (107 bytes), which pytest's tmp_path may not:
short_folder makes a folder under /tmp for them.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def short_folder() -> Iterator[Path]:
    """A new folder under /tmp (removed after), short enough for the sockets put in it."""
    folder = Path(tempfile.mkdtemp(dir="/tmp", prefix="sf"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def raw_answer_once(path: str | Path, answer: bytes) -> threading.Thread:
    """Listen on the unix socket `path`; to the first connection, once its request's head came
    whole, send `answer` as it is and close. The thread returned ends then (join it)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def serve() -> None:
        with listener:
            connection, _ = listener.accept()
            with connection:
                connection.settimeout(30)
                asked = b""
                while b"\r\n\r\n" not in asked:
                    got = connection.recv(65536)
                    if not got:
                        return
                    asked += got
                try:
                    connection.sendall(answer)
                except OSError:
                    pass  # the client gave up reading part way: what the test is about

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread
