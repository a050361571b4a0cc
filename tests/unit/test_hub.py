"""Pinning against a real HTTP hub (the fake hub, on this machine): a branch resolves to its
commit, a recorded pin needs no hub, a hub that cannot answer names engine, revision and fix."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sparkform.cli import main
from sparkform.commands.hub import HubError, resolve_pins, resolve_revision
from sparkform.domain.model import InventoryError
from sparkform.rules.inventory import load_host
from sparkform.sandbox.fakehub import FakeHub

REPO = "org/model"


@pytest.fixture
def hub(tmp_path):
    with FakeHub(tmp_path / "hub") as running:
        yield running


def publish(hub: FakeHub, folder: Path, text: str) -> str:
    folder.mkdir()
    (folder / "config.json").write_text(f'{{"note": "{text}"}}')
    return hub.add_repo(REPO, folder)


def requests_after(hub: FakeHub, sentinel: str) -> list[dict]:
    """The requests recorded so far, once the sentinel revision lookup made now is among them
    (the hub records a request after it answered it)."""
    with pytest.raises(HubError):
        resolve_revision(hub.url, REPO, sentinel)
    deadline = time.monotonic() + 5
    while not any(sentinel in r["path"] for r in hub.requests) and time.monotonic() < deadline:
        time.sleep(0.01)
    return [r for r in hub.requests if sentinel not in r["path"]]


def host_with(revision: str, endpoint: str):
    return load_host(
        "box",
        {
            "hf_endpoint": endpoint,
            "engines": [{"name": "m", "port": 8010, "checkpoint": {"repo": REPO, "revision": revision}}],
        },
    ).config


def test_a_branch_resolves_to_the_commit_it_names_now(hub, tmp_path):
    first = publish(hub, tmp_path / "a", "one")
    assert resolve_revision(hub.url, REPO, "main") == first
    moved = publish(hub, tmp_path / "b", "two")
    assert resolve_revision(hub.url, REPO, "main") == moved != first
    assert resolve_revision(hub.url, REPO, first) == first


def test_an_unknown_revision_or_repo_is_a_hub_error_naming_the_url(hub, tmp_path):
    publish(hub, tmp_path / "a", "one")
    with pytest.raises(HubError, match=r"/api/models/org/model/revision/nope answered 404"):
        resolve_revision(hub.url, REPO, "nope")
    with pytest.raises(HubError, match="answered 404"):
        resolve_revision(hub.url, "org/absent", "main")


def test_the_token_goes_in_a_header(hub, tmp_path):
    publish(hub, tmp_path / "a", "one")
    resolve_revision(hub.url, REPO, "main", token="hf_secret")
    (lookup,) = requests_after(hub, "sentinel")
    assert lookup["path"] == f"/api/models/{REPO}/revision/main" and lookup["authorization"] is True


def test_a_recorded_pin_wins_over_the_moved_branch(hub, tmp_path):
    first = publish(hub, tmp_path / "a", "one")
    publish(hub, tmp_path / "b", "two")
    config = host_with("main", hub.url)
    assert resolve_pins("box", config, {"org--model@main": first}) == {"m": first}
    assert requests_after(hub, "sentinel") == []  # no question to the hub


def test_a_commit_id_needs_no_hub():
    commit = "c" * 40
    config = host_with(commit, "http://127.0.0.1:9")  # nothing listens there
    assert resolve_pins("box", config, {}) == {"m": commit}
    assert config.pinned({}).commit(config.engines[0]) == commit


def test_an_unreachable_hub_names_host_engine_revision_and_fix():
    config = host_with("main", "http://127.0.0.1:9")
    with pytest.raises(InventoryError) as err:
        resolve_pins("box", config, {})
    message = str(err.value)
    assert message.startswith("box: engine m: checkpoint.revision = 'main': cannot resolve org/model@main")
    assert "pin a 40-hex commit id" in message


def test_pinned_config_points_folders_at_the_commit(hub, tmp_path):
    commit = publish(hub, tmp_path / "a", "one")
    config = host_with("main", hub.url)
    engine = config.engines[0]
    assert config.checkpoint_dir(engine).endswith("/org--model@main")  # unresolved, as written
    pinned = config.pinned(resolve_pins("box", config, {}))
    assert pinned.checkpoint_dir(engine).endswith(f"/org--model@{commit}")
    assert pinned.pin_path(engine).endswith("/.pins/org--model@main")


def test_plan_shows_what_a_branch_names_now_only_when_asked(hub, tmp_path, capsys):
    commit = publish(hub, tmp_path / "a", "one")
    inventory = tmp_path / "inv.py"
    inventory.write_text(
        "from sparkform.rules.inventory import hosts\n"
        f"box = hosts({{'box': {{'hf_endpoint': {hub.url!r}, 'engines': [{{'name': 'm', 'port': 8010, "
        f"'checkpoint': {{'repo': {REPO!r}, 'revision': 'main'}}}}]}}}}, __file__)\n"
    )
    assert main(["plan", str(inventory)]) == 0
    offline = capsys.readouterr().out
    assert "checkpoint of m: org/model main: a branch or tag; the first deploy pins" in offline
    assert commit not in offline
    assert main(["plan", str(inventory), "--resolve"]) == 0
    assert f"checkpoint of m: org/model main -> {commit} on the hub now" in capsys.readouterr().out


def test_without_a_token_file_huggingface_hub_s_token_store_is_used(hub, tmp_path, monkeypatch):
    publish(hub, tmp_path / "a", "one")
    monkeypatch.setenv("HF_TOKEN", "hf_from_the_store")
    resolve_revision(hub.url, REPO, "main")
    (lookup,) = requests_after(hub, "sentinel")
    assert lookup["authorization"] is True


def test_a_hub_error_never_shows_the_token(hub, tmp_path):
    publish(hub, tmp_path / "a", "one")
    with pytest.raises(HubError) as err:
        resolve_revision(hub.url, REPO, "nope", token="hf_secret_in_no_message")
    assert "answered 404" in str(err.value) and "hf_secret_in_no_message" not in str(err.value)
