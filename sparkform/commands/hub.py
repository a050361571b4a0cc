"""Pinning: a branch or tag in the inventory becomes the commit it names, asked of the hub once.

The first deploy of a named revision asks the hub (from the control machine, with the token
file the inventory names) and records the answer on the host after the checkpoint verified;
later deploys read the record, so a branch that moves on the hub changes nothing on the host
until the inventory's revision changes. A commit id needs no question at all.
"""

from __future__ import annotations

import urllib.parse
from pathlib import Path

from sparkform.domain.engine import Engine
from sparkform.domain.model import InventoryError, Problem
from sparkform.domain.schema import HostConfig
from sparkform.domain.shapes import COMMIT_ID

DEFAULT_ENDPOINT = "https://huggingface.co"


class HubError(RuntimeError):
    """The hub could not say which commit a revision names."""


def resolve_revision(endpoint: str, repo: str, revision: str, token: str | None = None) -> str:
    """The commit id `revision` (a branch, tag or commit) names in `repo`, asked through
    huggingface_hub (its proxies, retries and typed errors; without a token file, its token
    store). The token goes in a header, never in a message."""
    # Imported here: every command's parser imports this module, and only a resolve asks the hub
    # (huggingface_hub and its HTTP stack take a sixth of a second to import).
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    url = f"{endpoint.rstrip('/')}/api/models/{repo}/revision/{urllib.parse.quote(revision, safe='')}"
    try:
        commit = HfApi(endpoint=endpoint, token=token).model_info(repo, revision=revision).sha
    except HfHubHTTPError as err:
        response = err.response
        if response is None:
            raise HubError(f"{url}: {err}") from None
        # httpx's name for it (huggingface_hub >= 1.0), else requests' (older ones, still allowed)
        reason = getattr(response, "reason_phrase", None) or getattr(response, "reason", "")
        raise HubError(f"{url} answered {response.status_code} {reason}") from None
    except Exception as err:  # the transport's own errors (httpx's) share no narrower base class
        raise HubError(f"{url}: {err}") from None
    if commit is None or not COMMIT_ID.fullmatch(commit):
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
