"""Everything that lands on a host, rendered from templates/ for one validated host.

The tasks put these files as they are; tests render them too (golden files, systemd-analyze,
shellcheck), so what is tested is byte for byte what a Spark receives.
"""

from __future__ import annotations

import ipaddress
import json
import re
import shlex
from collections.abc import Mapping

import jinja2

from sparkform.domain import layout
from sparkform.domain.engine import API_ROUTES, Engine, pooling_flags
from sparkform.domain.layout import (
    COMPLETE_MARKER,
    ENGINES_TARGET,
    FRONT_CONFIG,
    FRONT_DROP_IN,
    GUARD_UNIT,
    NODE_EXPORTER_DEFAULTS,
    NODE_EXPORTER_DROP_IN,
    NODE_EXPORTER_PACKAGE,
    PROFILE_CAPS,
    RECOVER_UNIT,
    SCRUB_TIMER,
    SCRUB_UNIT,
    record_dir,
    unit_path,
)
from sparkform.domain.package_data import TEMPLATES
from sparkform.domain.rendered import RenderedFile
from sparkform.domain.schema import HostConfig
from sparkform.domain.shapes import CONTROL_CHARACTERS, NAME_PATTERN
from sparkform.host.front_keys import NO_CLIENT
from sparkform.host.kvlog import SETTING_FLAGS
from sparkform.rules import bootchain
from sparkform.writers.programs import checkpoint_fetch, guard_files, min_available_kib, program_files  # noqa: F401  (the names tests and tasks take from here)

_env = jinja2.Environment(
    loader=jinja2.FileSystemLoader(TEMPLATES),
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
    trim_blocks=True,
    lstrip_blocks=True,
    autoescape=False,
)
_env.globals["gib"] = lambda value: f"{int(value * 1024)}M"
_env.globals["layout"] = layout  # unit names: no template spells a prefix of its own
_env.globals["engine_name_pattern"] = NAME_PATTERN


# Characters that mean nothing to systemd's unit-file parser nor to a shell.
PLAIN_WORD = re.compile(r"[A-Za-z0-9._/:+=,@-]+")


def systemd_escaped(value: object, command: bool = False) -> str:
    """A value inside a double-quoted unit-file word, kept literal: specifiers (%), quotes and
    escapes; in a command line also variables ($). The schema already refuses these in every
    field; this holds should a template ever take a value the schema does not shape."""
    text = str(value)
    if CONTROL_CHARACTERS.search(text):
        raise ValueError(f"a control character cannot be written into a unit file: {text!r}")
    pairs = [("\\", "\\\\"), ('"', '\\"'), ("%", "%%")] + ([("$", "$$")] if command else [])
    for char, escaped in pairs:
        text = text.replace(char, escaped)
    return text


def root_writable(config: HostConfig, *folders: str) -> list[str]:
    """What a root service of sparkform may write (ReadWritePaths=): `folders`, root's record
    folder, and with monitoring node_exporter's textfile folder (its alert and GPU metrics)."""
    textfiles = [config.monitoring.textfile_dir] if config.monitoring.enabled else []
    return [*folders, record_dir(config.state_dir), *textfiles]


def systemd_word(value: object) -> str:
    """One argument of an Exec*= command line: as it is when plain, else quoted and escaped."""
    text = str(value)
    return text if PLAIN_WORD.fullmatch(text) else f'"{systemd_escaped(text, command=True)}"'


_env.filters["systemd_env"] = systemd_escaped
_env.filters["systemd_word"] = systemd_word
_env.filters["sh"] = lambda value: shlex.quote(str(value))


def prerequisite_packages(device: str) -> list[str]:
    """Debian packages a host needs: python3-venv builds the vLLM venv, curl and util-linux
    (flock) serve the launch script and the readiness helper, iproute2 (ss) checks the front's
    ports, nginx is the front that checks the API key, and its njs module runs the combined port's
    router. g++ and python3-dev (Python.h) are what
    vLLM's JIT paths compile with (torch inductor's C++ kernels, Triton's launcher, FlashInfer's
    nvcc host compiler): without them one request to such a path kills the engine. vLLM's CPU
    build loads libnuma."""
    packages = [
        "python3",
        "python3-venv",
        "python3-dev",
        "curl",
        "util-linux",
        "gawk",
        "iproute2",
        "nginx",
        "libnginx-mod-http-js",
        "g++",
    ]
    return packages + ["libnuma1"] if device == "cpu" else packages


# The front's allow-list is each engine's `routes` (sparkform.domain.engine.KIND_ROUTES, narrowed by its
# front_routes). Every other path (vLLM's /invocations, /generative_scoring, /scale_elastic_ep,
# /docs, ...) gets 404.
# Routes vLLM answers without asking for its own --api-key (it guards only /v1, /v2, /inference
# and /cohere: docs/incidents.md#open-lan-api). The front passes none; the tests and `sparkform
# verify` ask for each.
VLLM_UNGUARDED_ROUTES = (
    "/invocations", "/generative_scoring", "/tokenize", "/detokenize", "/metrics", "/docs", "/openapi.json",
    "/scale_elastic_ep", "/version", "/load", "/ping",
)  # fmt: skip


def engine_environment(config: HostConfig, engine: Engine) -> dict[str, str]:
    """The variables every launch path of this engine runs with: caps, CUDA, caches."""
    cache = config.engine_cache_dir(engine)
    return {
        **config.compile_caps.as_env(),
        "PATH": f"{config.cuda_home}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "CUDA_HOME": config.cuda_home,
        "HOME": config.paths.engine_home,
        "VLLM_CACHE_ROOT": f"{cache}/vllm",
        "FLASHINFER_WORKSPACE_BASE": cache,
        "TRITON_CACHE_DIR": f"{cache}/triton",
        "CUTE_DSL_CACHE_DIR": f"{cache}/cute-dsl",
        # torch inductor's kernels (compiled with g++ even under --enforce-eager): its default lies
        # in the unit's private /tmp, so every start would compile them again.
        "TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor",
        # vLLM's start-up connects to its own get_ip() (the LAN address) unless told: the unit
        # allows loopback only (IPAddressAllow=localhost).
        "VLLM_HOST_IP": "127.0.0.1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        # An engine on one host has a network of its own, loopback only: gloo would look for the
        # host name's address (127.0.1.1 on Debian) on an interface, and find none.
        **(span_environment(config, engine) if engine.nodes else {"GLOO_SOCKET_IFNAME": "lo"}),
    }


def span_environment(config: HostConfig, engine: Engine) -> dict[str, str]:
    """A rank's network: its own address on the link, and the interfaces NCCL and gloo must take
    (left to themselves they pick the first interface up, often the 10 GbE port)."""
    span = config.span(engine)
    interface = config.node_interface or ""
    environment = {
        "VLLM_HOST_IP": span.address,
        # "=": this interface exactly, not every name it prefixes.
        "NCCL_SOCKET_IFNAME": f"={config.nccl_socket_ifname or interface}",
        "GLOO_SOCKET_IFNAME": config.gloo_socket_ifname or interface,
    }
    if config.nccl_ib_hca:
        environment["NCCL_IB_HCA"] = "=" + ",".join(config.nccl_ib_hca)
    if config.device == "cpu":
        # vLLM's own command line (sparkform-vllm-serve) finds the CPU build's platform only so.
        environment["VLLM_TARGET_DEVICE"] = "cpu"
    return environment


def engine_args(config: HostConfig, engine: Engine) -> list[str]:
    """Arguments of the API server, one token each (the args file holds one per line; the guard
    reads the KV pool's settings back from it by SETTING_FLAGS)."""
    args = [
        SETTING_FLAGS["checkpoint"],
        config.checkpoint_dir(engine),
        "--served-model-name",
        *engine.names,
        # Behind the front, on no TCP port: only root, nginx and the engine's user reach its socket.
        "--uds",
        config.engine_socket(engine),
        # /docs and /openapi.json describe every route, guarded or not.
        "--disable-fastapi-docs",
        SETTING_FLAGS["max_model_len"],
        str(engine.max_model_len),
        "--max-num-seqs",
        str(engine.max_num_seqs),
        "--generation-config",
        engine.generation_config,
        *pooling_flags(engine.kind, config.pin(engine).version),
    ]
    if engine.kv_cache_memory_bytes:
        args += [SETTING_FLAGS["kv_cache_memory_bytes"], str(engine.kv_cache_memory_bytes)]
    else:
        args += [SETTING_FLAGS["gpu_memory_utilization"], f"{engine.gpu_memory_utilization:g}"]
    if engine.kv_cache_dtype != "auto":
        args += [SETTING_FLAGS["kv_cache_dtype"], engine.kv_cache_dtype]
    if engine.quantization:
        args += ["--quantization", engine.quantization]
    if not engine.enable_prefix_caching:
        args.append("--no-enable-prefix-caching")
    if engine.tool_call_parser:
        args += ["--enable-auto-tool-choice", "--tool-call-parser", engine.tool_call_parser]
    if engine.reasoning_parser:
        args += ["--reasoning-parser", engine.reasoning_parser]
    if engine.speculative_config:
        args += ["--speculative-config", json.dumps(engine.speculative_config, separators=(",", ":"))]
    if engine.language_model_only:
        args.append("--language-model-only")
    if engine.trust_remote_code:
        args.append("--trust-remote-code")
    return args + engine.extra_args + span_args(config, engine)


def span_args(config: HostConfig, engine: Engine) -> list[str]:
    """vLLM's native multi-node flags of this host's rank (none for an engine of one host): one
    rank per node, tensor parallel across them; ranks > 0 run without an API (`--headless`)."""
    if not engine.nodes:
        return []
    span = config.span(engine)
    size = str(engine.tensor_parallel_size)
    args = ["--tensor-parallel-size", size, "--nnodes", size, "--node-rank", str(config.rank(engine))]
    args += ["--master-addr", span.master_address, "--master-port", str(engine.master_port)]
    return args + (["--headless"] if config.is_worker(engine) else [])


def scrub_units(config: HostConfig) -> list[RenderedFile]:
    """The scrub's service and timer (the timer restarts when it changes)."""
    # The scrub's repair rewrites checkpoints and takes the host lock.
    writable = root_writable(config, config.models_dir, config.paths.host_lock_dir)
    return [
        RenderedFile(
            unit_path(SCRUB_UNIT), template("sparkform-scrub.service.j2", config=config, writable=writable), "644"
        ),
        RenderedFile(unit_path(SCRUB_TIMER), template("sparkform-scrub.timer.j2", config=config), "644"),
    ]


def combined_front(config: HostConfig) -> dict:
    """What the combined port's server needs: the router's table (JSON for njs, inside nginx's
    single quotes: served names and engine names hold no quote, backslash or $), the routes it
    routes by "model", and the largest body any engine takes."""
    engines = config.served_engines
    table = {
        "models": {name: engine.name for engine in engines for name in engine.names},
        "engines": {
            engine.name: {
                "routes": engine.routes,
                "limit": engine.request_limit_mib * 2**20,
                "window": engine.max_model_len,
            }
            for engine in engines
        },
    }
    return {
        "no_client": NO_CLIENT,
        "front_table": json.dumps(table, separators=(",", ":")),
        "combined_routes": [
            route for route in API_ROUTES if route != "/v1/models" and any(route in e.routes for e in engines)
        ],
        "combined_limit_mib": max((engine.request_limit_mib for engine in engines), default=1),
    }


def front_listen(config: HostConfig) -> tuple[str, str]:
    """nginx's listen address (IPv6 in brackets) and options for `listen_address`."""
    address = ipaddress.ip_address(config.listen_address)
    if address.version == 4:
        return config.listen_address, ""
    return f"[{config.listen_address}]", " ipv6only=off" if address.is_unspecified else ""


def bracketed(address: str) -> str:
    """An address as it goes before `:port` (IPv6 in brackets)."""
    return f"[{address}]" if ipaddress.ip_address(address).version == 6 else address


def monitoring_packages(config: HostConfig) -> list[str]:
    """Debian packages monitoring adds: node_exporter (none while it is off)."""
    return [NODE_EXPORTER_PACKAGE] if config.monitoring.enabled else []


def node_exporter_files(config: HostConfig) -> list[RenderedFile]:
    """node_exporter's settings (Debian's ARGS) and the drop-in that limits who reaches it; a
    change to either restarts it. None while monitoring is off."""
    if not config.monitoring.enabled:
        return []
    return [
        RenderedFile(
            NODE_EXPORTER_DEFAULTS,
            template("node-exporter.default.j2", config=config, listen=bracketed(config.monitoring.listen_address)),
            "644",
        ),
        RenderedFile(NODE_EXPORTER_DROP_IN, template("node-exporter-access.conf.j2", config=config), "644"),
    ]


def template(name: str, **context) -> str:
    """templates/NAME rendered with `context`."""
    return _env.get_template(name).render(**context)


def render_host(config: HostConfig, model_configs: Mapping[str, dict] | None = None) -> list[RenderedFile]:
    """Every file sparkform puts on the host, with its path and mode (`model_configs`: the
    checkpoints' config.json by engine, for the KV ledger's prediction in the guard's settings)."""
    paths = config.paths
    files = [
        RenderedFile(
            paths.launch, template("sparkform-launch.sh.j2", config=config, complete_marker=COMPLETE_MARKER), "755"
        ),
        RenderedFile(paths.wait_ready, template("sparkform-wait-ready.sh.j2", config=config), "755"),
        *program_files(config, model_configs),
        RenderedFile(
            PROFILE_CAPS, template("profile-caps.sh.j2", config=config, caps=config.compile_caps.as_env()), "644"
        ),
        RenderedFile(layout.ENGINE_SOCKETS_TMPFILES, template("engine-sockets.tmpfiles.j2", config=config), "644"),
    ]
    if config.enabled_engines:
        files.append(
            RenderedFile(unit_path(ENGINES_TARGET), template("sparkform-engines.target.j2", config=config), "644")
        )
    files += [
        RenderedFile(
            unit_path(GUARD_UNIT),
            template("sparkform-guard.service.j2", config=config, writable=root_writable(config)),
            "644",
        ),
        RenderedFile(
            unit_path(RECOVER_UNIT),
            template("sparkform-recover@.service.j2", config=config, writable=root_writable(config)),
            "644",
        ),
        *scrub_units(config),
    ]
    listen, listen_options = front_listen(config)
    files += [
        RenderedFile(
            FRONT_CONFIG,
            template(
                "nginx-front.conf.j2",
                config=config,
                key=config.front_keyed,
                tls=config.front_tls_on,
                **combined_front(config),
                listen=listen,
                listen_options=listen_options,
            ),
            "644",
        ),
        RenderedFile(FRONT_DROP_IN, template("nginx-hardening.conf.j2"), "644"),
        *node_exporter_files(config),
    ]
    for engine in config.engines:
        environment = engine_environment(config, engine)
        env_file, args_file = config.paths.engine_settings(engine.name)
        files += [
            RenderedFile(
                unit_path(engine.unit),
                template(
                    "engine.service.j2",
                    config=config,
                    engine=engine,
                    environment=environment,
                    after_units=bootchain.after_units(config, engine),
                ),
                "644",
                engine.name,
            ),
            RenderedFile(
                env_file,
                template(
                    "engine.env.j2",
                    config=config,
                    engine=engine,
                    environment=environment,
                    min_available_kib=min_available_kib(config, engine),
                ),
                "644",
                engine.name,
            ),
            RenderedFile(args_file, template("engine.args.j2", args=engine_args(config, engine)), "644", engine.name),
        ]
    return files
