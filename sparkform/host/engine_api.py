"""Root's requests to an engine's own API: HTTP/1.1 over the engine's unix socket (it has no TCP
port), each socket operation bounded by a deadline and the answer read up to a size bound. The
engine is the process that parses untrusted prompts: whatever it answers, a request fails as
None, never as an exception of its caller."""

import http.client
import json
import socket


class BoundedResponse(http.client.HTTPResponse):
    """An answer whose chunk sizes are counts: http.client reads a negative one as "read to the
    end", past any bound."""

    def _read_next_chunk_size(self):
        size = super()._read_next_chunk_size()
        if size < 0:
            raise http.client.IncompleteRead(b"")
        return size


class UnixConnection(http.client.HTTPConnection):
    """An HTTP connection to the unix socket at `socket_path` (Host: localhost)."""

    response_class = BoundedResponse

    def __init__(self, socket_path, timeout):
        super().__init__("localhost", timeout=timeout)
        self.socket_path = socket_path

    def connect(self):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def answer(socket_path, route, timeout_s, limit, body=None):
    """(status, at most `limit` + 1 bytes of the answer) of a GET of `route`, or a JSON POST of
    `body`, to the engine on `socket_path`; None when it did not answer as HTTP."""
    connection = UnixConnection(socket_path, timeout_s)
    try:
        if body is None:
            connection.request("GET", route)
        else:
            connection.request("POST", route, json.dumps(body).encode(), {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read(limit + 1)
    except (OSError, ValueError, http.client.HTTPException):
        return None
    finally:
        connection.close()
