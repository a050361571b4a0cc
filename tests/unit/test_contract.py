"""The request contract per vLLM version (sparkform/reports/contract.py): the table, the operator guide's copy of
it, the judges on captured answers of each version, the prompt that fills the window, and the
curl that carries every request (run for real against a local server)."""

from __future__ import annotations

import json
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from sparkform.commands.contract import HostAsker, curl_script, parse_curl
from sparkform.host.front_keys import clients_snippet
from sparkform.reports.contract import (
    CONTRACTS,
    NoAnswer,
    Reply,
    Request,
    contract_for,
    contract_table,
    judge_over_input,
    judge_over_window,
    judge_reasoning,
    judge_tokenize,
    judge_version,
    judge_vision,
    judge_window,
)
from sparkform.reports.contract_requests import GAP, check_engine, near_window_prompt
from sparkform.rules.inventory import load_host

REPO = Path(__file__).resolve().parents[2]
CAPTURED = REPO / "tests" / "fixtures" / "captured" / "contract"


def captured(name: str) -> dict:
    return json.loads((CAPTURED / name).read_text())


OVER_WINDOW = sorted(path.name for path in CAPTURED.glob("vllm-*-over-window-*.json"))


def test_the_operators_guide_shows_the_contract_table():
    assert contract_table() in (REPO / "docs" / "operator.md").read_text(), (
        "the contract table of docs/operator.md differs from sparkform/reports/contract.py: "
        "`sparkform contract --table` prints it"
    )


@pytest.mark.parametrize(
    ("version", "answer"),
    [
        ("0.20.0", "error"),
        ("0.27.1", "error"),
        ("0.31.2", "error"),
        ("0.32.0", "truncate"),
        ("0.32.0+cpu", "truncate"),
        ("0.33.1rc1", "truncate"),
        ("0.19.9", None),
        ("0.34.0", None),
        ("1.31.0", None),
        ("not a version", None),
    ],
)
def test_each_version_has_its_row(version, answer):
    row = contract_for(version)
    assert (row.over_window if row else None) == answer


def test_the_rows_follow_each_other_without_gap_or_overlap():
    for before, after in zip(CONTRACTS, CONTRACTS[1:], strict=False):
        assert after.first == (before.last[0], before.last[1] + 1), (before.versions, after.versions)
    assert [row.over_window for row in CONTRACTS] == ["error", "truncate"]


def test_captured_answers_of_both_kinds_are_here():
    versions = {captured(name)["vllm"]: captured(name)["status"] for name in OVER_WINDOW}
    assert {"0.27.1": 400, "0.31.0": 400, "0.32.0": 200}.items() <= versions.items(), versions


@pytest.mark.parametrize("name", OVER_WINDOW)
def test_a_captured_over_window_answer_passes_its_versions_contract_only(name):
    case = captured(name)
    reply = Reply(case["status"], case["body"])
    own = contract_for(case["vllm"])
    held = judge_over_window(own, case["window"], case["max_tokens"], reply)
    assert held.result == "pass", held.detail
    assert held.detail.startswith("HTTP 400 (error)" if case["status"] == 400 else "HTTP 200 (truncation)")
    other = next(row for row in CONTRACTS if row is not own)
    broken = judge_over_window(other, case["window"], case["max_tokens"], reply)
    assert broken.result == "fail", broken.detail


def test_an_older_versions_400_naming_another_window_or_max_tokens_fails():
    case = captured("vllm-0.31.0-over-window-400.json")
    row, reply = contract_for("0.31.0"), Reply(400, case["body"])
    assert judge_over_window(row, 4096, case["max_tokens"], reply).result == "fail"
    assert judge_over_window(row, case["window"], case["max_tokens"] + 1, reply).result == "fail"


def test_an_older_version_that_answers_another_400_fails():
    other = json.dumps({"error": {"message": "max_tokens must be at least 1, got 0.", "type": "BadRequestError"}})
    finding = judge_over_window(contract_for("0.27.1"), 2048, 34, Reply(400, other))
    assert finding.result == "fail" and "max_tokens must be at least 1" in finding.detail


def test_a_truncation_that_is_not_cut_to_the_window_fails():
    case = captured("vllm-0.32.0-over-window-200.json")
    body = json.loads(case["body"])
    body["usage"]["completion_tokens"] -= 1  # stopped early: not the cut to L - n
    finding = judge_over_window(
        contract_for("0.32.0"), case["window"], case["max_tokens"], Reply(200, json.dumps(body))
    )
    assert finding.result == "fail" and "cuts max_tokens to" in finding.detail


def test_the_window_is_each_served_names_max_model_len():
    host = load_host(
        "h",
        {
            "engines": [
                {
                    "name": "e",
                    "port": 8010,
                    "checkpoint": {"repo": "o/r", "revision": "main"},
                    "served_names": ["e", "vision"],
                    "max_model_len": 2048,
                }
            ]
        },
    )
    engine = host.config.engines[0]

    def models(*entries):
        return Reply(200, json.dumps({"data": [{"id": i, "max_model_len": w} for i, w in entries]}))

    assert judge_window(engine, models(("e", 2048), ("vision", 2048))).result == "pass"
    assert "does not list vision" in judge_window(engine, models(("e", 2048))).detail
    assert judge_window(engine, models(("e", 2048), ("vision", 4096))).result == "fail"
    assert judge_window(engine, Reply(401, '{"error":"Unauthorized"}')).detail.startswith("/v1/models: HTTP 401")


def test_tokenize_is_a_lower_bound_of_the_prompt_tokens():
    chat = Reply(200, json.dumps({"usage": {"prompt_tokens": 20, "completion_tokens": 1}, "choices": [{}]}))
    assert judge_tokenize(Reply(200, '{"count": 14}'), chat).result == "pass"
    assert judge_tokenize(Reply(200, '{"count": 20}'), chat).result == "pass"
    assert judge_tokenize(Reply(200, '{"count": 21}'), chat).result == "fail"
    assert judge_tokenize(Reply(404, "Not Found"), chat).result == "fail"


def test_reasoning_is_spent_from_max_tokens():
    case = captured("vllm-0.32.0-reasoning-200.json")
    assert judge_reasoning(case["max_tokens"], Reply(200, case["body"])).result == "pass"
    body = json.loads(case["body"])
    details = body["usage"]["completion_tokens_details"]
    details["reasoning_tokens"] = body["usage"]["completion_tokens"] + 1  # counted beside the budget
    assert judge_reasoning(case["max_tokens"], Reply(200, json.dumps(body))).result == "fail"
    body["usage"]["completion_tokens"] = case["max_tokens"] + 1
    assert judge_reasoning(case["max_tokens"], Reply(200, json.dumps(body))).result == "fail"


def test_an_image_refused_by_a_text_only_engine_fails_the_vision_check():
    case = captured("vllm-0.32.0-vision-text-only-400.json")
    finding = judge_vision(case["model"], Reply(case["status"], case["body"]))
    assert finding.result == "fail" and finding.detail.endswith("HTTP 400: q38 is not a multimodal model")
    answered = {"choices": [{"finish_reason": "length"}], "usage": {"prompt_tokens": 80, "completion_tokens": 4}}
    assert judge_vision("vision", Reply(200, json.dumps(answered))).result == "pass"


def test_a_version_the_inventory_does_not_pin_or_the_table_lacks_fails():
    assert judge_version("0.32.0", "0.32.0")[0].result == "pass"
    finding, row = judge_version("0.32.0", "0.27.1")
    assert finding.result == "fail" and "converge first" in finding.detail and row is contract_for("0.32.0")
    finding, row = judge_version("0.34.0", "0.34.0")
    assert finding.result == "fail" and row is None and "CONTRACTS" in finding.detail


def word_tokenizer(limit: int):
    """/tokenize of a tokenizer with a BOS and one token a word, refusing prompts over `limit`."""

    def ask(request: Request) -> Reply:
        count = 1 + len(request.body["prompt"].split())
        return Reply(400, "{}") if count > limit else Reply(200, json.dumps({"count": count}))

    return ask


@pytest.mark.parametrize("window", [256, 2048, 262144])
def test_the_over_window_prompt_lands_just_under_the_window(window):
    text, tokens = near_window_prompt(word_tokenizer(window), "m", window)
    assert window - 2 * GAP <= tokens < window and tokens == 1 + len(text.split())


def test_no_prompt_is_made_when_tokenize_refuses():
    assert near_window_prompt(lambda request: Reply(404, "Not Found"), "m", 2048) is None


def pooling_engine(kind: str, window: int, dimensions: int = 8):
    """vLLM's pooling engine as a client sees it: one token a word (plus a BOS), /v1/models with
    the window, and its pooling route: an embedding (or a rerank) of an input within the window,
    HTTP 400 over it."""

    def ask(request: Request) -> Reply:
        body = request.body or {}
        if request.path == "/v1/models":
            return Reply(200, json.dumps({"data": [{"id": "emb", "max_model_len": window}]}))
        text = body.get("prompt") or body.get("input") or " ".join(body.get("documents", []))
        count = 1 + len(text.split())
        if count > window:
            return Reply(400, json.dumps({"error": {"message": f"maximum context length is {window} tokens"}}))
        if request.path == "/tokenize":
            return Reply(200, json.dumps({"count": count}))
        if request.path == "/v1/embeddings" and kind == "embed":
            return Reply(200, json.dumps({"data": [{"embedding": [0.5] * dimensions, "index": 0}]}))
        if request.path == "/rerank" and kind != "embed":
            return Reply(200, json.dumps({"results": [{"index": 0, "relevance_score": 0.25}]}))
        return Reply(404, json.dumps({"error": {"message": "Not Found"}}))

    return ask


@pytest.mark.parametrize("kind", ["embed", "rerank"])
def test_a_pooling_engines_contract_checks_shape_window_and_long_input(kind):
    host = load_host(
        "h", {"engines": [{"name": "emb", "port": 8004, "kind": kind, "max_model_len": 512,
                           "checkpoint": {"repo": "BAAI/bge-m3", "revision": "main"}}]}
    ).config  # fmt: skip
    findings = {f.check: f for f in check_engine(pooling_engine(kind, 512), host, host.engines[0], host.vllm_version)}
    assert findings["window"].result == "pass"
    if kind == "embed":
        assert findings["name emb"].observed == {"dimensions": 8} and "8 dimensions" in findings["name emb"].detail
    else:
        assert findings["name emb"].result == "pass" and "relevance_score" in findings["name emb"].detail
    over = findings["over window"]
    assert over.result == "pass" and "is refused, nothing cut: HTTP 400" in over.detail
    assert over.observed["input_tokens"] > 512
    assert {findings[c].result for c in ("tokenize", "reasoning", "vision")} == {"skip"}
    # A generator's contract asked of it fails: it answers no completion.
    generator = host.engines[0].model_copy(update={"kind": "generate"})
    names = [
        f for f in check_engine(pooling_engine(kind, 512), host, generator, host.vllm_version) if f.check == "name emb"
    ]
    assert names[0].result == "fail"


@pytest.mark.parametrize("status", [404, 401, 500])
def test_an_over_window_answer_other_than_vllm_s_400_fails(status):
    finding = judge_over_input(512, 560, Reply(status, json.dumps({"error": {"message": "no"}})))
    assert finding.result == "fail" and f"HTTP {status}" in finding.detail


def test_an_embedding_without_a_vector_fails():
    def ask(request: Request) -> Reply:
        if request.path == "/v1/embeddings":
            return Reply(200, json.dumps({"data": [{"embedding": "nope"}]}))
        return pooling_engine("embed", 512)(request)

    host = load_host(
        "h", {"engines": [{"name": "emb", "port": 8004, "kind": "embed", "max_model_len": 512,
                           "checkpoint": {"repo": "BAAI/bge-m3", "revision": "main"}}]}
    ).config  # fmt: skip
    (name,) = [f for f in check_engine(ask, host, host.engines[0], host.vllm_version) if f.check == "name emb"]
    assert name.result == "fail" and "without a vector" in name.detail


class FrontStandIn(BaseHTTPRequestHandler):
    """Answers every request with 200 and what it was sent."""

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"])).decode()
        self._answer({"authorization": self.headers.get("Authorization"), "path": self.path, "body": body})

    def do_GET(self):
        self._answer({"authorization": self.headers.get("Authorization"), "path": self.path, "body": None})

    def _answer(self, data):
        payload = json.dumps(data).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def front():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FrontStandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def host_with_key(tmp_path: Path, port: int):
    """A host whose front is the stand-in on `port` and whose key snippet lies in tmp_path."""
    (tmp_path / "key").write_text("k" * 32 + "\n")
    (tmp_path / "key").chmod(0o600)
    data = {
        "config_dir": str(tmp_path / "etc"),
        "api_key_file": str(tmp_path / "key"),
        "engines": [{"name": "e", "port": port, "checkpoint": {"repo": "o/r", "revision": "main"}}],
    }
    config = load_host("h", data).config
    Path(config.paths.front_key).parent.mkdir(parents=True)
    Path(config.paths.front_key).write_text(clients_snippet({"default": "s" * 40, "other": "o" * 40}))
    return config, config.engines[0]


def test_curl_carries_the_key_from_the_front_snippet_and_the_body_on_stdin(tmp_path, front):
    config, engine = host_with_key(tmp_path, front)
    body = {"model": "e", "prompt": "it's a 'quoted' \"prompt\"", "max_tokens": 1}
    script = curl_script(config, engine, Request("/v1/completions", body), 10)
    assert "s" * 40 not in script and "quoted" not in script  # neither the key nor the body is in argv
    reply = HostAsker(["sh", "-c"], config, engine, 10)(Request("/v1/completions", body))
    seen = json.loads(reply.body)
    assert reply.status == 200
    assert seen == {"authorization": f"Bearer {'s' * 40}", "path": "/v1/completions", "body": json.dumps(body)}


def test_an_engine_that_does_not_answer_is_named_with_curls_reason(tmp_path, front):
    config, engine = host_with_key(tmp_path, front)  # nothing listens on the engine's own socket
    with pytest.raises(
        NoAnswer,
        match=r"^/version on the engine's own socket \(/run/sparkform-engines/\w+/api\.sock\): connection refused$",
    ):
        HostAsker(["sh", "-c"], config, engine, 10)(Request("/version", front=False))


def test_a_reply_without_a_status_is_none():
    assert parse_curl("") is None
    assert parse_curl("\n@@sparkform-http:000") is None
    assert parse_curl('{"a": 1}\n@@sparkform-http:200') == Reply(200, '{"a": 1}')


def test_contract_exits_3_naming_host_and_engine_when_host_does_not_answer():
    result = subprocess.run(
        [
            str(Path(__import__("sys").executable).with_name("sparkform")),
            "contract",
            str(REPO / "inventory" / "sandbox.py"),
            "--engine",
            "q38",
        ],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "SPARKFORM_SANDBOX": "no-such-sandbox"},
        timeout=120,
    )
    assert result.returncode == 3, result.stderr
    assert result.stderr.startswith(
        "sparkform contract: no-such-sandbox-not-up q38: /version: the host does not answer over SSH"
    )
    assert result.stderr.count("\n") == 1


@pytest.mark.parametrize("body", ["not json", "[]", '{"usage": "x", "choices": [1]}', '{"choices": [{"message": 7}]}'])
def test_a_garbled_answer_fails_every_judge_and_raises_nothing(body):
    host = load_host("h", {"engines": [{"name": "e", "port": 8010, "checkpoint": {"repo": "o/r", "revision": "main"}}]})
    reply = Reply(200, body)
    findings = [
        judge_window(host.config.engines[0], reply),
        judge_tokenize(reply, reply),
        judge_over_window(contract_for("0.32.0"), 2048, 33, reply),
        judge_over_window(contract_for("0.31.0"), 2048, 33, reply),
        judge_reasoning(16, reply),
    ]
    assert [finding.result for finding in findings] == ["fail"] * len(findings), [f.detail for f in findings]
