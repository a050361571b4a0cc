"""Where sparkform puts things on a host: unit names and the paths of what it writes.

One home for every name the deploy, the facts, the templates (they get this module as
`layout` and a host's `HostPaths` as `paths`), `sparkform/verify` and the integration tests use.
The folders themselves are inventory fields (`HostConfig.lib_dir`, `state_dir`, ...);
`HostPaths` places sparkform's files inside them. A leaf of the core: it imports only the
names the host programs define themselves (sparkform.host), so the schema can name units with it.
"""

from __future__ import annotations

import posixpath
import shlex
from dataclasses import dataclass

from sparkform.host import RETRY_UNIT_PREFIX, ROOT_PYTHON, SETTINGS_SUFFIX
from sparkform.host.folders import COMPLETE_MARKER
from sparkform.host.folders import MANIFEST as CHECKPOINT_MANIFEST
from sparkform.host.kept import KEPT_FILES, KEPT_PREVIOUS, KEPT_RECORD, ROLLBACK_RECORD

__all__ = [
    "CHECKPOINT_MANIFEST", "COMPLETE_MARKER", "KEPT_FILES", "KEPT_PREVIOUS", "KEPT_RECORD", "ROLLBACK_RECORD",
    "RETRY_UNIT_PREFIX", "ROOT_PYTHON",
]  # fmt: skip

UNIT_DIR = "/etc/systemd/system"
UNIT_PREFIX = "vllm-"  # engine NAME runs as unit vllm-NAME.service
ENGINE_UNIT_GLOB = f"{UNIT_DIR}/{UNIT_PREFIX}*.service"
ENGINES_TARGET = "sparkform-engines.target"  # reached once every enabled engine serves
GUARD_UNIT = "sparkform-guard.service"
# WatchdogSec= of the guard: six of its keep-alives (sparkform.host.guard.KEEPALIVE_S) missed.
GUARD_WATCHDOG_S = 30
# RETRY_UNIT_PREFIX (sparkform.host): the guard's delayed start of ENGINE, sparkform-retry-ENGINE.timer
RECOVER_UNIT = "sparkform-recover@.service"  # the engines' OnFailure=, one instance per engine
# The checkpoint scrub (HostConfig.scrub): the timer starts the service, a one-shot run.
SCRUB_UNIT = "sparkform-scrub.service"
SCRUB_TIMER = "sparkform-scrub.timer"
FRONT_UNIT = "nginx.service"
FRONT_CONFIG = "/etc/nginx/conf.d/sparkform.conf"
# Debian's nginx error log, which the front's servers keep at notice and above: nginx logs a
# client's invalid or too long header lines at info, the Authorization line (the key) with them.
FRONT_ERROR_LOG = "/var/log/nginx/error.log"
# The front's access log: one line per request with the client's name (api_keys), never a key.
FRONT_ACCESS_LOG = "/var/log/nginx/sparkform-access.log"
FRONT_DROP_IN = f"{UNIT_DIR}/nginx.service.d/sparkform-hardening.conf"
# Debian's nginx runs as this user, and its nginx.conf writes the master's pid here: the front's
# master runs as that user too (templates/nginx-hardening.conf.j2), and reads the API key as its group.
FRONT_USER = "www-data"
FRONT_PID_FILE = "/run/nginx.pid"
# Debian's nginx.service checks the configuration first with this (its ExecStartPre=).
FRONT_CONFIG_TEST = "/usr/sbin/nginx -t -q -g 'daemon on; master_process on;'"
# Debian's welcome page on port 80 of every address: nothing a Spark should serve to the LAN.
NGINX_DEFAULT_SITE = "/etc/nginx/sites-enabled/default"
# Debian's main nginx configuration: the deploy sets its worker_connections line (front_connections).
NGINX_MAIN_CONFIG = "/etc/nginx/nginx.conf"
PROFILE_CAPS = "/etc/profile.d/sparkform-caps.sh"  # the compile caps for login shells
# ROOT_PYTHON (sparkform.host): how root runs its Python programs: the system's python3, isolated
# (-I: no PYTHON* variables, no user site under $HOME, no script folder on sys.path), so nothing
# the engine user can write (its HOME, a .pth, a usercustomize) runs as root.
# Monitoring (HostConfig.monitoring): Debian's prometheus-node-exporter, its settings, and the
# textfiles sparkform writes for its collector: one per writer, each replaced whole.
NODE_EXPORTER_PACKAGE = "prometheus-node-exporter"
NODE_EXPORTER_UNIT = "prometheus-node-exporter.service"
NODE_EXPORTER_DEFAULTS = "/etc/default/prometheus-node-exporter"  # ARGS=, read by Debian's unit
NODE_EXPORTER_DROP_IN = f"{UNIT_DIR}/prometheus-node-exporter.service.d/sparkform-access.conf"
RECORD_TEXTFILE = "sparkform.prom"  # the host record's metrics, written with the record
GUARD_TEXTFILE = "sparkform-guard.prom"  # the guard's alerts, written by the guard
FRONT_TEXTFILE = "sparkform-front.prom"  # requests per client of the front, counted by the guard
GPU_TEXTFILE = "sparkform-gpu.prom"  # the GPU's temperature, clock and clock-event reasons, sampled by the guard
# COMPLETE_MARKER (sparkform.host.folders) is written last into a venv or a checkpoint folder:
# without it the folder is unfinished, and the launch script refuses the checkpoint.
# CHECKPOINT_MANIFEST beside it holds the path, size, sha256 and mtime of every verified file.
VENV_LOCK = "sparkform-lock.txt"  # the lock a venv was installed from, inside that venv
RECORD_NAME = "host-record.json"
# In the record folder: one JSON line per engine start that served, with the KV pool vLLM printed
# and the planner's prediction (sparkform-guard served appends it; `sparkform ledger` reads it).
KV_LEDGER_NAME = "kv-ledger.jsonl"
KV_LEDGER_ROWS = 1000  # the rows kept: the oldest go first
# `sparkform bench`'s ledger in the record folder: one JSON line per bench, appended by root.
BENCH_LEDGER_NAME = "bench-ledger.jsonl"
# In an engine's kept folder (kept_dir), as sparkform-rollback names them (sparkform.host.kept):
# KEPT_FILES (copies, in the order of HostPaths.engine_files), KEPT_RECORD (what they are),
# ROLLBACK_RECORD (after they were put back, why) and KEPT_PREVIOUS/ (the settings kept before
# the last ones, what `sparkform rollback` goes back to from a change that served but misbehaves).


def monitored_units_pattern() -> str:
    """node_exporter's --collector.systemd.unit-include: the engines, their target, the guard, the
    recovery units and their retry timers, the scrub and its timer. `[.]` rather than a
    backslash: the pattern passes through an environment file and systemd's $ARGS splitting."""
    engine = f"{UNIT_PREFIX}.+[.]service"
    target, guard = (unit.replace(".", "[.]") for unit in (ENGINES_TARGET, GUARD_UNIT))
    recover = RECOVER_UNIT.replace("@.service", "@.+[.]service")
    scrub = SCRUB_UNIT.removesuffix(".service")
    return f"({engine}|{target}|{guard}|{recover}|{RETRY_UNIT_PREFIX}.+[.](service|timer)|{scrub}[.](service|timer))"


def engine_unit(engine_name: str) -> str:
    return f"{UNIT_PREFIX}{engine_name}.service"


def engine_identifier(engine_name: str) -> str:
    """The engine's name in the journal (SyslogIdentifier=): its unit without `.service`."""
    return engine_unit(engine_name).removesuffix(".service")


# Each engine serves its API on a unix socket in a folder of its own (no TCP port), inside the
# host's socket_dir: the folder is its user's, group FRONT_USER, setgid, mode 2750 (systemd-tmpfiles
# makes it at boot), so only root, the front and that engine's user reach the socket, and nobody
# else can put one there.
ENGINE_SOCKETS_TMPFILES = "/etc/tmpfiles.d/sparkform-engines.conf"


def engine_socket_dir(socket_dir: str, engine_name: str) -> str:
    return f"{socket_dir}/{engine_name}"


def engine_socket(socket_dir: str, engine_name: str) -> str:
    """The unix socket engine `engine_name`'s API serves on (vLLM's --uds)."""
    return f"{engine_socket_dir(socket_dir, engine_name)}/api.sock"


def engine_curl(socket: str, path: str) -> str:
    """curl's arguments that reach `path` of an engine itself, on its `socket` (as root)."""
    return f"--unix-socket {shlex.quote(socket)} {shlex.quote('http://localhost' + path)}"


def recover_unit(engine_name: str) -> str:
    return RECOVER_UNIT.replace("@", f"@{engine_name}")


def unit_path(unit: str) -> str:
    return f"{UNIT_DIR}/{unit}"


def is_unit_path(path: str) -> bool:
    """systemd reads it: a unit file or a drop-in."""
    return path.startswith(f"{UNIT_DIR}/")


def engine_of_unit_path(path: str) -> str | None:
    """The engine a unit file sparkform wrote runs (None for any other file)."""
    folder, name = posixpath.split(path)
    if folder != UNIT_DIR or not name.startswith(UNIT_PREFIX) or not name.endswith(".service"):
        return None
    return name.removeprefix(UNIT_PREFIX).removesuffix(".service")


def venv_marker(venv: str) -> str:
    """Holds the venv's pin once its install completed."""
    return f"{venv}/{COMPLETE_MARKER}"


def venv_lock(venv: str) -> str:
    """The lock on the host, inside the venv built from it."""
    return f"{venv}/{VENV_LOCK}"


def venv_install_log(venv: str) -> str:
    """pip's whole output of the venv's build (root's, 0600), inside that venv."""
    return f"{venv}/pip-install.log"


def record_dir(state_dir: str) -> str:
    """Root's folder for the record, the cache keys, the guard's state and the stamps."""
    return posixpath.join(state_dir, "record")


def cache_keys_dir(state_dir: str) -> str:
    """Root's folder of the key each engine's caches were built under, one file per engine,
    written once the engine served with them: a rebuild that fails halfway keeps what the first
    engine did. Not in the cache folder: the engine writes there, and root reads the key back."""
    return posixpath.join(record_dir(state_dir), "cache-keys")


def record_path(state_dir: str) -> str:
    """Where the host record lives on the host."""
    return posixpath.join(record_dir(state_dir), RECORD_NAME)


def kv_ledger_path(state_dir: str) -> str:
    """The KV pool ledger on the host (root's, 0644)."""
    return posixpath.join(record_dir(state_dir), KV_LEDGER_NAME)


def kept_root(state_dir: str) -> str:
    """Root's folder of the engines' kept folders (kept_dir)."""
    return posixpath.join(record_dir(state_dir), "kept")


def kept_dir(state_dir: str, engine_name: str) -> str:
    """Root's copy (0700) of the settings the engine last served with: its unit, env and args
    files as they were, and KEPT_RECORD (the date, venv, checkpoint folder and digest). A
    deploy replaces it whole once the engine serves new settings; a rollback writes them back."""
    return posixpath.join(kept_root(state_dir), engine_name)


def applied_stamp(state_dir: str, service: str) -> str:
    """Root's record of the inputs `service` last (re)started or reloaded with: a run cut off
    between writing a file and the reload leaves it stale, so the next run still reloads."""
    return posixpath.join(record_dir(state_dir), f"applied-{service}")


@dataclass(frozen=True)
class HostPaths:
    """sparkform's files inside one host's folders."""

    lib_dir: str
    config_dir: str
    state_dir: str

    @property
    def launch(self) -> str:
        """The engines' ExecStart, and the hand run."""
        return f"{self.lib_dir}/sparkform-launch"

    @property
    def vllm_cli(self) -> str:
        """vLLM's own `vllm serve` CLI for the ranks of an engine across hosts; run by the venv's python."""
        return f"{self.lib_dir}/sparkform-vllm-serve"

    @property
    def wait_ready(self) -> str:
        """The readiness helper, the engines' ExecStartPost."""
        return f"{self.lib_dir}/sparkform-wait-ready"

    @property
    def checkpoint(self) -> str:
        """Fetches and proves a checkpoint; run by the venv's python (it needs huggingface_hub)."""
        return f"{self.lib_dir}/sparkform-checkpoint"

    @property
    def record(self) -> str:
        """Writes the host record; run by the system's python3."""
        return f"{self.lib_dir}/sparkform-record"

    @property
    def guard(self) -> str:
        """The watchdog, memory guard and alerts; run by the system's python3."""
        return f"{self.lib_dir}/sparkform-guard"

    @property
    def scrub(self) -> str:
        """Re-hashes the checkpoints against their manifests; run by the system's python3."""
        return f"{self.lib_dir}/sparkform-scrub"

    @property
    def rollback(self) -> str:
        """Puts an engine back on its kept settings; run by the system's python3 (the deploy
        after a failed start, `sparkform rollback` by hand)."""
        return f"{self.lib_dir}/sparkform-rollback"

    @property
    def engine_home(self) -> str:
        """The engine user's HOME: its own, inside root's state folder."""
        return f"{self.state_dir}/home"

    @property
    def host_lock_dir(self) -> str:
        """Root's alone: the host lock and its holder's line."""
        return f"{self.state_dir}/hostlock"

    @property
    def host_lock(self) -> str:
        """The host lock: one deploy, rollback or scrub repair at a time (sparkform.host.hostlock)."""
        return f"{self.host_lock_dir}/lock"

    @property
    def lock_dir(self) -> str:
        """The launch locks: each engine's lock and state, and the start lock they share."""
        return f"{self.state_dir}/locks"

    @property
    def front_router(self) -> str:
        """The combined front port's router, run by nginx's njs module (sparkform/host/front_router.js)."""
        return f"{self.lib_dir}/sparkform-front-router.js"

    @property
    def host_modules(self) -> str:
        """The package's sparkform/host (the programs and the modules they share), which the
        launcher at each program's path puts first on sys.path."""
        return f"{self.lib_dir}/python"

    @property
    def guard_config(self) -> str:
        """The guard's settings, beside it (sparkform.host.settings_path)."""
        return f"{self.guard}{SETTINGS_SUFFIX}"

    @property
    def scrub_config(self) -> str:
        return f"{self.scrub}{SETTINGS_SUFFIX}"

    @property
    def rollback_config(self) -> str:
        return f"{self.rollback}{SETTINGS_SUFFIX}"

    @property
    def retired_settings(self) -> tuple[str, str]:
        """Where the guard's and the scrub's settings were before they moved beside them: removed."""
        return f"{self.config_dir}/guard.json", f"{self.config_dir}/scrub.json"

    @property
    def engines_dir(self) -> str:
        return f"{self.config_dir}/engines"

    def engine_settings(self, engine_name: str) -> tuple[str, str]:
        """The engine's environment file and arguments file (read by the launch script)."""
        return f"{self.engines_dir}/{engine_name}.env", f"{self.engines_dir}/{engine_name}.args"

    def engine_files(self, engine_name: str) -> tuple[str, str, str]:
        """The files an engine runs with (unit, env, args): what a rollback puts back."""
        return (unit_path(engine_unit(engine_name)), *self.engine_settings(engine_name))

    def kept(self, engine_name: str) -> str:
        return kept_dir(self.state_dir, engine_name)

    @property
    def secrets_dir(self) -> str:
        """Root's, every file in it 0600."""
        return f"{self.config_dir}/secrets"

    @property
    def hf_token(self) -> str:
        return f"{self.secrets_dir}/hf_token"

    @property
    def front_key(self) -> str:
        """The API key as an nginx snippet, read by nginx's master process (root) only."""
        return f"{self.secrets_dir}/front-api-key.conf"

    @property
    def front_tls_key(self) -> str:
        """The private key of the front's certificate, read by nginx's master as the front's group."""
        return f"{self.secrets_dir}/front-tls.key"

    @property
    def front_certificate(self) -> str:
        """The front's certificate (its chain after it): public, what clients trust (`sparkform cert`)."""
        return f"{self.config_dir}/front-tls.pem"

    @property
    def front_public_key(self) -> str:
        """The public key of the front's certificate: the host's own requests to the front pin it."""
        return f"{self.config_dir}/front-tls.pub.pem"

    @property
    def alert_webhook(self) -> str:
        return f"{self.secrets_dir}/alert-webhook"

    @property
    def retired_engine_env(self) -> str:
        """The engines' copy of the API key from before the front: removed wherever it is left."""
        return f"{self.secrets_dir}/engine.env"

    @property
    def host_record(self) -> str:
        return record_path(self.state_dir)

    @property
    def kv_ledger(self) -> str:
        return kv_ledger_path(self.state_dir)

    @property
    def cache_keys(self) -> str:
        return cache_keys_dir(self.state_dir)

    @property
    def bench_ledger(self) -> str:
        """`sparkform bench`'s dated rows, root's (in the record folder)."""
        return posixpath.join(record_dir(self.state_dir), BENCH_LEDGER_NAME)

    def stamp(self, service: str) -> str:
        return applied_stamp(self.state_dir, service)
