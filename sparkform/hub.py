"""Pinning: a branch or tag in the inventory becomes the commit it names, asked of the hub once.

The first deploy of a named revision asks the hub (from the control machine, with the token
file the inventory names) and records the answer on the host after the checkpoint verified;
later deploys read the record, so a branch that moves on the hub changes nothing on the host
until the inventory's revision changes. A commit id needs no question at all.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from sparkform.engine import Engine
from sparkform.model import InventoryError, Problem
from sparkform.schema import HostConfig
from sparkform.shapes import COMMIT_ID

DEFAULT_ENDPOINT = "https://huggingface.co"
TIMEOUT_S = 20.0


class HubError(RuntimeError):
    """The hub could not say which commit a revision names."""


def resolve_revision(endpoint: str, repo: str, revision: str, token: str | None = None) -> str:
    """The commit id `revision` (a branch, tag or commit) names in `repo`, per the hub's API."""
    url = f"{endpoint.rstrip('/')}/api/models/{repo}/revision/{urllib.parse.quote(revision, safe='')}"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            commit = json.load(response).get("sha", "")
    except urllib.error.HTTPError as err:
        raise HubError(f"{url} answered {err.code} {err.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as err:
        raise HubError(f"{url}: {getattr(err, 'reason', err)}") from None
    if not COMMIT_ID.fullmatch(str(commit)):
        raise HubError(f"{url} named no commit (sha = {commit!r})")
    return commit


def resolve_pins(host: str, config: HostConfig, recorded: dict[str, str]) -> dict[str, str]:
    """The commit of each engine's checkpoint: a commit id as written, else the host's record
    of its revision (`recorded`: pin name -> commit), else the hub's answer now.

    Raises InventoryError naming the engine and revision when the hub cannot answer, before
    anything on the host changes.
    """
    commits, problems = {}, []
    for engine in config.engines:
        checkpoint = engine.checkpoint
        commit = config.commit(engine) or recorded.get(checkpoint.pin_name)
        if commit is None:
            try:
                commit = resolve_revision(
                    config.hf_endpoint or DEFAULT_ENDPOINT, checkpoint.repo, checkpoint.revision, _token(config)
                )
            except HubError as err:
                problems.append(_unresolved(host, engine, str(err)))
                continue
        commits[engine.name] = commit
    if problems:
        raise InventoryError(problems)
    return commits


def _token(config: HostConfig) -> str | None:
    return Path(config.hf_token_file).read_text().strip() if config.hf_token_file else None


def _unresolved(host: str, engine: Engine, why: str) -> Problem:
    return Problem(
        host,
        "checkpoint.revision",
        engine.checkpoint.revision,
        f"cannot resolve {engine.checkpoint.repo}@{engine.checkpoint.revision} to a commit: {why}",
        "check hf_endpoint, hf_token_file and the repo/revision, or pin a 40-hex commit id",
        engine=engine.name,
    )
