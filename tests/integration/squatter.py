"""A stranger on an engine's unix socket, run inside a sandbox: `python3 squatter.py SOCKET
NAME...` answers /health, /v1/models (listing NAMEs) and every POST as vLLM would, so only a
check of who holds the socket tells it from the engine. Standard library only (the box's python3)."""

import json
import socketserver
import sys
from http.server import BaseHTTPRequestHandler


class Handler(BaseHTTPRequestHandler):
    def address_string(self):
        return "unix"  # a unix socket's peer has no address

    def log_message(self, *args):
        pass

    def answer(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.answer({"object": "list", "data": [{"id": name, "object": "model"} for name in sys.argv[2:]]})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.answer({"choices": [{"index": 0, "text": "x"}]})


if __name__ == "__main__":
    socketserver.ThreadingUnixStreamServer(sys.argv[1], Handler).serve_forever()
