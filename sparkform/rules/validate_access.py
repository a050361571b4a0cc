"""Validation rules about who can read, write and reach what, before any connection is opened:
root's folders apart from each other and from the engine user's, secrets that are root's alone,
no hub or front in clear text where it crosses a network, and an API key of a sane shape.

Each problem names the host, the engine, the field, the value and the fix (sparkform.rules.validate
runs these with the other rules).
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path

from sparkform.domain.model import Host, Problem
from sparkform.domain.schema import HostConfig
from sparkform.domain.shapes import API_KEY_MAX_LENGTH, API_KEY_MIN_LENGTH, API_KEY_PATTERN, DEFAULT_CLIENT
from sparkform.rules.front_tls import BadCertificate, owners_certificate

SECRET_FILE_FIELDS = ("hf_token_file", "alert_webhook_file")  # and the clients' keys (secret_fields)
WEBHOOK_URL = re.compile(r"https?://[^\s\x00-\x1f]+")  # one URL, nothing a shell or header could split


def root_folders_apart(host: Host) -> list[Problem]:
    """Root reads back and runs what lies in these folders: none may lie where an engine writes
    (its cache folder under cache_root), or an engine could plant what root then trusts."""
    cfg = host.config
    problems = []
    for field_name in ("state_dir", "models_dir", "config_dir", "lib_dir", "venv_root"):
        path = getattr(cfg, field_name)
        if f"{path}/".startswith(f"{cfg.cache_root}/"):
            problems.append(
                Problem(
                    host.name,
                    field_name,
                    path,
                    f"lies inside cache_root ({cfg.cache_root}), where the engines write",
                    "give it a folder outside cache_root, e.g. the default",
                )
            )
    return problems


def inside(path: str, folder: str) -> bool:
    """Whether `path` is `folder` or lies under it."""
    return f"{path}/".startswith(f"{folder.rstrip('/')}/")


def root_apart_from_the_engine(host: Host) -> list[Problem]:
    """No folder root writes, reads back or runs from, no program root runs (alert_command, an
    absolute python, cuda_home's tools) may lie at or under a folder the engine user can write
    (its home, the launch locks, each engine's cache folder); and no engine's cache folder may
    be or lie in a root folder (cache_root equal to the record, an engine named `kept`)."""
    cfg = host.config
    paths = cfg.paths
    writable = {
        "the engine user's home": paths.engine_home,
        "the launch locks": paths.lock_dir,
        **{f"engine {e.name}'s cache folder": cfg.engine_cache_dir(e) for e in cfg.engines},
    }
    root_owned = {
        "models_dir": cfg.models_dir,
        "config_dir": cfg.config_dir,
        "lib_dir": cfg.lib_dir,
        "venv_root": cfg.venv_root,
        "alert_command": cfg.alert_command,
        "python": cfg.python if cfg.python.startswith("/") else None,
        "cuda_home": cfg.cuda_home,
    }
    problems = []
    for field_name, path in root_owned.items():
        for what, folder in writable.items():
            if path and inside(path, folder):
                problems.append(
                    Problem(
                        host.name,
                        field_name,
                        path,
                        f"lies in {what} ({folder}), which the engine user can write: root would run or trust "
                        "what a compromised engine put there",
                        f"give {field_name} a path outside {folder}, e.g. the default",
                    )
                )
    root_folders = {"state_dir": cfg.state_dir, **{k: v for k, v in root_owned.items() if k.endswith("_dir")}}
    for engine in cfg.engines:
        cache = cfg.engine_cache_dir(engine)
        for field_name, root_folder in root_folders.items():
            if root_folder and inside(cache, root_folder) and not inside(cache, paths.engine_home):
                problems.append(
                    Problem(
                        host.name,
                        "cache_root",
                        cfg.cache_root,
                        f"engine {engine.name}'s cache folder {cache} lies in {field_name} ({root_folder}), root's: "
                        "the engine would write where root reads",
                        "give cache_root a folder of its own outside every folder of root's, e.g. the default",
                    )
                )
    return problems


def secret_fields(host: Host) -> list[tuple[str, str]]:
    """(field, file) of every secret file the inventory names: each client's key is its own field."""
    cfg = host.config
    fields = [(name, getattr(cfg, name)) for name in SECRET_FILE_FIELDS]
    fields += [
        ("api_key_file" if client == DEFAULT_CLIENT and cfg.api_key_file else f"api_keys.{client}", path)
        for client, path in cfg.client_key_files.items()
    ]
    return [(name, path) for name, path in fields if path is not None]


def secret_files(host: Host) -> list[Problem]:
    problems = []
    keys: dict[str, str] = {}  # key -> the field that holds it
    for field_name, path in secret_fields(host):
        file = Path(path).expanduser()
        if not file.is_file():
            problems.append(
                Problem(
                    host.name,
                    field_name,
                    path,
                    "no such file on this machine",
                    "write the secret to that file (chmod 600) or unset the field",
                    deploy_only=True,
                )
            )
        elif file.stat().st_mode & 0o077:
            problems.append(
                Problem(host.name, field_name, path, "the secret file is readable by other users", f"chmod 600 {path}")
            )
        elif field_name.startswith("api_key"):
            key = file.read_text().strip()
            problems += api_key_shape(host.name, field_name, path, key)
            if key in keys:
                problems.append(
                    Problem(
                        host.name,
                        field_name,
                        path,
                        f"holds the same key as {keys[key]}: the access log could not tell the two clients apart",
                        f"give each client a key of its own: openssl rand -hex 32 > {path}",
                    )
                )
            keys.setdefault(key, field_name)
        elif field_name == "alert_webhook_file" and not WEBHOOK_URL.fullmatch(file.read_text().strip()):
            problems.append(
                Problem(
                    host.name,
                    field_name,
                    path,
                    "the file does not hold one http(s) URL",
                    f"write the webhook's URL alone into {path}, e.g. https://ntfy.sh/TOPIC",
                )
            )
    return problems


def hub_in_clear(host: Host) -> list[Problem]:
    """The HF token goes to hf_endpoint with every request: never in clear over a network,
    unless the owner says so by name (hf_endpoint_allow_http)."""
    endpoint = host.config.hf_endpoint
    if not endpoint or not endpoint.startswith("http://") or host.config.hf_endpoint_allow_http:
        return []
    address = endpoint.removeprefix("http://").split("/", 1)[0].rsplit(":", 1)[0]
    if address == "localhost" or loopback(address):
        return []
    return [
        Problem(
            host.name,
            "hf_endpoint",
            endpoint,
            "plain http to another host would carry the HF token in clear",
            "use https://, or set hf_endpoint_allow_http = True for a mirror on a network you trust",
        )
    ]


def loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def api_key_shape(host: str, field_name: str, path: str, key: str) -> list[Problem]:
    """The key goes into the front's config as a bearer token: its characters and length are
    checked here (the message never shows the key)."""
    if API_KEY_PATTERN.fullmatch(key) and API_KEY_MIN_LENGTH <= len(key) <= API_KEY_MAX_LENGTH:
        return []
    return [
        Problem(
            host,
            field_name,
            path,
            f"the key must be a bearer token of {API_KEY_MIN_LENGTH} to {API_KEY_MAX_LENGTH} characters from "
            "A-Z a-z 0-9 . _ ~ + / - (and = at the end), on one line",
            f"write a new key: openssl rand -hex 32 > {path}",
        )
    ]


def ports_taken(cfg: HostConfig) -> dict[int, str]:
    """The host's ports other than the combined front's -> who takes each."""
    taken = {}
    for engine in cfg.engines:
        if engine.nodes:
            taken[engine.master_port] = f"the ranks of engine {engine.name} meet on it (its master_port)"
        taken[engine.port] = f"engine {engine.name} listens on it"
    if cfg.monitoring.enabled:
        taken[cfg.monitoring.port] = "node_exporter listens on it (monitoring.port)"
    return taken


def front(host: Host) -> list[Problem]:
    """The front listens on each engine's port and on front_port; the engine binds port + offset on
    loopback."""
    cfg = host.config
    problems = []
    if cfg.serves_lan and not cfg.front_keyed and not cfg.open_lan_api_without_key:
        problems.append(
            Problem(
                host.name,
                "listen_address",
                cfg.listen_address,
                "serves every engine to the LAN without an API key: anyone who reaches the box runs the models",
                "set api_key_file (or api_keys) to a file holding the key, or listen_address: "
                "127.0.0.1 to keep the models on the host; to serve the LAN without a key on "
                "purpose, set open_lan_api_without_key: true",
            )
        )
    if cfg.api_key_file and DEFAULT_CLIENT in cfg.api_keys:
        problems.append(
            Problem(
                host.name,
                f"api_keys.{DEFAULT_CLIENT}",
                cfg.api_keys[DEFAULT_CLIENT],
                f"api_key_file is the client {DEFAULT_CLIENT!r} already",
                f"give this client another name, or move api_key_file into api_keys as {DEFAULT_CLIENT!r}",
            )
        )
    taken = cfg.front_port is not None and ports_taken(cfg).get(cfg.front_port)
    if taken:
        problems.append(
            Problem(
                host.name,
                "front_port",
                cfg.front_port,
                f"{taken}: two services cannot listen on one port",
                "give the combined front a port of its own (default 8000), or front_port: null for none",
            )
        )
    return problems


def front_tls_files(host: Host) -> list[Problem]:
    """The owner's certificate and key for the front: files on this machine, the key root's
    alone, the key the certificate's, the certificate not ended."""
    tls = host.config.front_tls
    if not host.config.front_tls_on or tls.cert_file is None or tls.key_file is None:
        return []
    cert, key = Path(tls.cert_file).expanduser(), Path(tls.key_file).expanduser()
    for field_name, file in (("front_tls.cert_file", cert), ("front_tls.key_file", key)):
        if not file.is_file():
            return [
                Problem(
                    host.name,
                    field_name,
                    str(file),
                    "no such file on this machine",
                    "give the PEM file's path",
                    deploy_only=True,
                )
            ]
    if key.stat().st_mode & 0o077:
        return [
            Problem(
                host.name, "front_tls.key_file", str(key), "the key file is readable by other users", f"chmod 600 {key}"
            )
        ]
    try:
        owners_certificate(cert.read_text(errors="replace"), key.read_text(errors="replace"))
    except BadCertificate as err:
        return [
            Problem(
                host.name,
                "front_tls.cert_file",
                str(cert),
                str(err),
                "give the server's certificate (then its chain) and its own unencrypted key, both PEM; or unset both "
                "for a self-signed one",
            )
        ]
    return []
