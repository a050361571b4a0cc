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
from dataclasses import dataclass

import jinja2

from sparkform import bootchain, layout, ledger
from sparkform.bundle import TEMPLATES
from sparkform.engine import Engine
from sparkform.layout import (
    CHECKPOINT_MANIFEST,
    COMPLETE_MARKER,
    ENGINES_TARGET,
    FRONT_CONFIG,
    FRONT_DROP_IN,
    GUARD_UNIT,
    KEPT_FILES,
    KEPT_PREVIOUS,
    KEPT_RECORD,
    KV_LEDGER_ROWS,
    NODE_EXPORTER_DEFAULTS,
    NODE_EXPORTER_DROP_IN,
    NODE_EXPORTER_PACKAGE,
    PROFILE_CAPS,
    RECOVER_UNIT,
    ROLLBACK_RECORD,
    SCRUB_TIMER,
    SCRUB_UNIT,
    kept_root,
    record_dir,
    unit_path,
)
from sparkform.model import Host
from sparkform.modelconfig import GIB
from sparkform.parsers import KV_LOG_PATTERNS
from sparkform.schema import HostConfig
from sparkform.shapes import CONTROL_CHARACTERS, NAME_PATTERN

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
    ports, nginx is the front that checks the API key. g++ and python3-dev (Python.h) are what
    vLLM's JIT paths compile with (torch inductor's C++ kernels, Triton's launcher, FlashInfer's
    nvcc host compiler): without them one request to such a path kills the engine. vLLM's CPU
    build loads libnuma."""
    packages = ["python3", "python3-venv", "python3-dev", "curl", "util-linux", "gawk", "iproute2", "nginx", "g++"]
    return packages + ["libnuma1"] if device == "cpu" else packages


# How long a rank this host runs for a head elsewhere may take from its start to its connection to
# the head's master port (importing vLLM; tens of seconds on the sandbox's two cores) before the
# guard judges that connection.
RANK_JOIN_S = 120
# The front's allow-list: the OpenAI routes a chat or completion client uses. Every other path
# (vLLM's /invocations, /tokenize, /generative_scoring, /scale_elastic_ep, /docs, ...) gets 404.
FRONT_ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions")
# Routes vLLM answers without asking for its own --api-key (it guards only /v1, /v2, /inference
# and /cohere: docs/incidents.md#open-lan-api). The front passes none; the tests and `sparkform
# verify` ask for each.
VLLM_UNGUARDED_ROUTES = (
    "/invocations", "/generative_scoring", "/tokenize", "/detokenize", "/metrics", "/docs", "/openapi.json",
    "/scale_elastic_ep", "/version", "/load", "/ping",
)  # fmt: skip
# journalctl MESSAGE_ID=... lists every alert the guard sent.
ALERT_MESSAGE_ID = "7d3f5c2a9e8b4f61a0c4d2e6b8f1a3c5"


@dataclass(frozen=True)
class RenderedFile:
    path: str
    content: str
    mode: str
    engine: str | None = None  # the engine that must restart when this file changes

    @property
    def is_unit(self) -> bool:
        """systemd reads it: a unit file or a drop-in."""
        return layout.is_unit_path(self.path)


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
        **(span_environment(config, engine) if engine.nodes else {}),
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
    """Arguments of the API server, one token each (the args file holds one per line)."""
    args = [
        "--model",
        config.checkpoint_dir(engine),
        "--served-model-name",
        *engine.names,
        # Behind the front: only nginx (and the readiness helper) reach the engine itself.
        "--host",
        "127.0.0.1",
        "--port",
        str(config.internal_port(engine)),
        # /docs and /openapi.json describe every route, guarded or not.
        "--disable-fastapi-docs",
        "--max-model-len",
        str(engine.max_model_len),
        "--max-num-seqs",
        str(engine.max_num_seqs),
        "--generation-config",
        engine.generation_config,
    ]
    if engine.kv_cache_memory_bytes:
        args += ["--kv-cache-memory-bytes", str(engine.kv_cache_memory_bytes)]
    else:
        args += ["--gpu-memory-utilization", f"{engine.gpu_memory_utilization:g}"]
    if engine.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", engine.kv_cache_dtype]
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


def min_available_kib(config: HostConfig, engine: Engine) -> int:
    """MemAvailable the launch script wants before it starts this engine."""
    if engine.kv_cache_memory_bytes:
        share = engine.kv_cache_memory_bytes
    else:
        share = engine.gpu_memory_utilization * config.memory_total_gib * GIB
    return int((share + config.memory_available_margin_gib * GIB) // 1024)


def guard_files(config: HostConfig) -> tuple[str, str, str, str]:
    """The guard's settings, script, unit and the engines' OnFailure= unit: a change to any of
    them restarts the guard."""
    return config.paths.guard_config, config.paths.guard, unit_path(GUARD_UNIT), unit_path(RECOVER_UNIT)


def guard_settings(config: HostConfig, model_configs: Mapping[str, dict] | None = None) -> dict:
    """What sparkform-guard knows about the host (no secret: the webhook URL stays in its file).
    `model_configs` (engine -> config.json, the inventory's model_config_path) feed the planner's
    prediction that each start's KV ledger row carries."""
    host = Host("", config, dict(model_configs or {}))
    return {
        # need_gib: the MemAvailable the launch script wants before it starts the engine.
        "engines": [
            {
                "name": e.name,
                "unit": e.unit,
                "port": config.internal_port(e),
                "names": e.names,
                "priority": e.priority,
                "need_gib": round(min_available_kib(config, e) / 2**20, 2),
                "ledger": ledger.guard_ledger(host, e),
                # A rank this host runs headless: where its head's master port is (no API to probe here).
                "head": [config.span(e).master_address, e.master_port] if config.is_worker(e) else None,
            }
            for e in config.enabled_engines
        ],
        "state_dir": record_dir(config.state_dir),
        "webhook_file": config.paths.alert_webhook if config.alert_webhook_file else None,
        "alert_command": config.alert_command,
        "textfile": config.monitoring.guard_textfile if config.monitoring.enabled else None,
        "gpu_textfile": config.monitoring.gpu_textfile if config.monitoring.enabled else None,
        "kv_ledger": config.paths.kv_ledger,
        "kv_ledger_rows": KV_LEDGER_ROWS,
        **{
            key: getattr(config, key)
            for key in (
                "recover_cooldown_s",
                "recover_backoff_max_s",
                "watchdog_interval_s",
                "watchdog_deadline_s",
                "watchdog_failures",
                "memory_warn_gib",
                "memory_critical_gib",
                "memory_margin_gib",
            )
        },
        "memory_poll_s": 2,
        "rank_join_s": RANK_JOIN_S,
        "vllm_cli": config.paths.vllm_cli,
        "memory_settle_s": 10,
        "gpu_poll_s": 15,
    }


def checkpoint_fetch(config: HostConfig, engine: Engine) -> list[str]:
    """The fetch of an engine's checkpoint, as the deploy and the scrub run it (argv; HF_TOKEN and
    HF_ENDPOINT go in its environment, never here)."""
    includes = [word for pattern in engine.checkpoint.include for word in ("--include", pattern)]
    return [
        f"{config.venv}/bin/python",
        "-I",  # root runs it: no PYTHON* variables, no user site, no script folder on sys.path
        config.paths.checkpoint,
        engine.checkpoint.repo,
        config.commit(engine) or engine.checkpoint.revision,
        config.checkpoint_dir(engine),
        *includes,
        "--workers",
        str(config.checkpoint_workers),
    ]


def scrub_settings(config: HostConfig) -> dict:
    """What sparkform-scrub knows: each checkpoint an enabled engine serves, with its fetch and the
    engines to restart after a repair; the token's path, never the token."""
    folders: dict[str, dict] = {}
    for engine in config.enabled_engines:
        checkpoint = folders.setdefault(
            config.checkpoint_dir(engine),
            {
                "folder": config.checkpoint_dir(engine),
                "repo": engine.checkpoint.repo,
                "commit": config.commit(engine),
                "fetch": checkpoint_fetch(config, engine),
                "engines": [],
            },
        )
        checkpoint["engines"].append({"name": engine.name, "unit": engine.unit})
    return {
        "checkpoints": list(folders.values()),
        "rate_mib_s": config.scrub.rate_mib_s,
        "hf_endpoint": config.hf_endpoint,
        "hf_token_file": config.paths.hf_token if config.hf_token_file else None,
        "guard": config.paths.guard,
    }


def scrub_files(config: HostConfig) -> list[RenderedFile]:
    """The scrub's script, settings, service and timer (the timer restarts when it changes)."""
    paths = config.paths
    return [
        RenderedFile(
            paths.scrub,
            template(
                "sparkform-scrub.py.j2",
                scrub_config=paths.scrub_config,
                complete_marker=COMPLETE_MARKER,
                manifest=CHECKPOINT_MANIFEST,
            ),
            "644",
        ),
        RenderedFile(paths.scrub_config, json.dumps(scrub_settings(config), indent=2) + "\n", "644"),
        RenderedFile(
            unit_path(SCRUB_UNIT),
            template("sparkform-scrub.service.j2", config=config, writable=root_writable(config, config.models_dir)),
            "644",
        ),
        RenderedFile(unit_path(SCRUB_TIMER), template("sparkform-scrub.timer.j2", config=config), "644"),
    ]


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


def rollback_script(config: HostConfig) -> str:
    """sparkform-rollback for this host: the files of each engine it can put back, and where they are kept."""
    engines = {
        engine.name: {"unit": engine.unit, "files": list(config.paths.engine_files(engine.name))}
        for engine in config.engines
    }
    return template(
        "sparkform-rollback.py.j2",
        engines=json.dumps(engines, indent=4, sort_keys=True),
        kept_root=kept_root(config.state_dir),
        kept_files=json.dumps(list(KEPT_FILES)),
        kept_record=KEPT_RECORD,
        kept_previous=KEPT_PREVIOUS,
        rollback_record=ROLLBACK_RECORD,
        complete_marker=COMPLETE_MARKER,
        guard=config.paths.guard,
        target=ENGINES_TARGET,
    )


def template(name: str, **context) -> str:
    """templates/NAME rendered with `context`."""
    return _env.get_template(name).render(**context)


def render_host(config: HostConfig, model_configs: Mapping[str, dict] | None = None) -> list[RenderedFile]:
    """Every file sparkform puts on the host, with its path and mode (`model_configs`: the
    checkpoints' config.json by engine, for the KV ledger's prediction in guard.json)."""
    paths = config.paths
    files = [
        RenderedFile(
            paths.launch, template("sparkform-launch.sh.j2", config=config, complete_marker=COMPLETE_MARKER), "755"
        ),
        RenderedFile(paths.wait_ready, template("sparkform-wait-ready.sh.j2", config=config), "755"),
        # Run by the venv's python (it needs huggingface_hub), so not executable on its own.
        RenderedFile(
            paths.checkpoint,
            template("sparkform-checkpoint.py.j2", complete_marker=COMPLETE_MARKER, manifest=CHECKPOINT_MANIFEST),
            "644",
        ),
        # Run by the system's python3 at the end of a converge.
        RenderedFile(paths.record, template("sparkform-record.py.j2"), "644"),
        # Run by the system's python3 after a changed engine's failed start, or by hand.
        RenderedFile(paths.rollback, rollback_script(config), "644"),
        # Run by the venv's python for the ranks of an engine across hosts.
        *(
            [RenderedFile(paths.vllm_cli, template("sparkform-vllm-serve.py.j2"), "644")]
            if any(engine.nodes for engine in config.engines)
            else []
        ),
        RenderedFile(
            PROFILE_CAPS, template("profile-caps.sh.j2", config=config, caps=config.compile_caps.as_env()), "644"
        ),
    ]
    if config.enabled_engines:
        files.append(
            RenderedFile(unit_path(ENGINES_TARGET), template("sparkform-engines.target.j2", config=config), "644")
        )
    guard_config, guard_script, guard_unit, recover_unit = guard_files(config)
    files += [
        RenderedFile(
            guard_script,
            template(
                "sparkform-guard.py.j2",
                guard_config=guard_config,
                message_id=ALERT_MESSAGE_ID,
                kv_patterns={name: repr(pattern) for name, pattern in KV_LOG_PATTERNS.items()},
                checkpoint_pattern=repr(ledger.CHECKPOINT_PATTERN),
                kv_dtype_pattern=repr(ledger.KV_DTYPE_PATTERN),
            ),
            "644",
        ),
        RenderedFile(guard_config, json.dumps(guard_settings(config, model_configs), indent=2) + "\n", "644"),
        RenderedFile(
            guard_unit,
            template(
                "sparkform-guard.service.j2", config=config, guard_config=guard_config, writable=root_writable(config)
            ),
            "644",
        ),
        RenderedFile(
            recover_unit,
            template(
                "sparkform-recover@.service.j2",
                config=config,
                guard_config=guard_config,
                writable=root_writable(config),
            ),
            "644",
        ),
        *scrub_files(config),
    ]
    listen, listen_options = front_listen(config)
    files += [
        RenderedFile(
            FRONT_CONFIG,
            template(
                "nginx-front.conf.j2",
                config=config,
                routes=FRONT_ROUTES,
                key=config.api_key_file is not None,
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
