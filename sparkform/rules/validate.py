"""The validation rules: what one host's data must hold, beyond each field's own shape, before any
connection is opened (sparkform.rules.inventory.load_host runs them).

Each problem names the host, the engine, the field, the value and the fix. Field-shape errors
come from the pydantic schema; the rules here are the ones that need the whole host: the memory
pool, uniqueness, the boot chain, the compile storm, the MTP/vision trade-off.
"""

from __future__ import annotations

from pathlib import Path

from sparkform.domain import locks, modelconfig, vllm_versions
from sparkform.domain.engine import Engine
from sparkform.domain.locks import VllmPin
from sparkform.domain.model import Host, Problem
from sparkform.domain.schema import HostConfig
from sparkform.domain.shapes import COMMIT_ID
from sparkform.rules import bootchain
from sparkform.rules import validate_access as access
from sparkform.rules.planner import node_memory_problems, state_block_problems


def host_problems(host: Host) -> list[Problem]:
    problems: list[Problem] = []
    for rule in (
        access.root_folders_apart,
        access.root_apart_from_the_engine,
        _memory_pool,
        _unique,
        access.front,
        _memory_floors,
        bootchain.chain_problems,
        _mtp_and_vision,
        _timeouts,
        _cgroup_caps,
        _compile_storm,
        _cpu_pool,
        _native_window,
        access.secret_files,
        access.front_tls_files,
        access.hub_in_clear,
        _wheelhouse,
        _lock,
        _vllm_takes,
        _spanning,
        state_block_problems,
        node_memory_problems,
    ):
        problems += rule(host)
    return problems


def _memory_pool(host: Host) -> list[Problem]:
    cfg = host.config
    engines = cfg.enabled_engines
    share = sum(engine.gpu_memory_utilization for engine in engines)
    budget = cfg.memory_total_gib - cfg.memory_headroom_gib
    if share * cfg.memory_total_gib <= budget + 1e-9:
        return []
    terms = " + ".join(f"{e.gpu_memory_utilization:.2f} ({e.name})" for e in engines)
    return [
        Problem(
            host.name,
            "gpu_memory_utilization",
            {e.name: e.gpu_memory_utilization for e in engines},
            f"{terms} = {share:.2f} of {cfg.memory_total_gib:.1f} GiB is "
            f"{share * cfg.memory_total_gib:.1f} GiB, over the {budget:.1f} GiB left after "
            f"{cfg.memory_headroom_gib:.1f} GiB of headroom",
            f"lower the utilizations so they sum to at most {budget / cfg.memory_total_gib:.2f} "
            f"(`sparkform plan` recommends a split), or lower memory_headroom_gib knowingly",
        )
    ]


def _unique(host: Host) -> list[Problem]:
    problems = []
    seen_names: set[str] = set()
    ports: dict[int, str] = {}
    served: dict[str, str] = {}
    for engine in host.config.engines:
        if engine.name in seen_names:
            problems.append(
                Problem(
                    host.name,
                    "name",
                    engine.name,
                    "two engines share this name",
                    "give each engine its own name",
                    engine.name,
                )
            )
        seen_names.add(engine.name)
        if engine.port in ports:
            problems.append(
                Problem(
                    host.name,
                    "port",
                    engine.port,
                    f"engine {ports[engine.port]} already listens on it",
                    "give each engine its own port",
                    engine.name,
                )
            )
        ports.setdefault(engine.port, engine.name)
        for alias in engine.names:
            if alias in served and served[alias] != engine.name:
                problems.append(
                    Problem(
                        host.name,
                        "served_names",
                        alias,
                        f"engine {served[alias]} already answers to this name, so clients could "
                        f"not tell which model serves them",
                        "serve each name from one engine only",
                        engine.name,
                    )
                )
            served.setdefault(alias, engine.name)
    return problems


def _mtp_and_vision(host: Host) -> list[Problem]:
    problems = []
    for engine in host.config.engines:
        spec = engine.speculative_config or {}
        vision_names = [name for name in engine.names if "vision" in name.lower()]
        if spec.get("method") == "mtp" and not engine.language_model_only:
            problems.append(
                Problem(
                    host.name,
                    "speculative_config",
                    spec,
                    "MTP speculative decoding needs language_model_only: true on these checkpoints",
                    "set language_model_only: true (this drops the vision tower) or remove speculative_config",
                    engine.name,
                )
            )
        if engine.language_model_only and (engine.multimodal or vision_names):
            problems.append(
                Problem(
                    host.name,
                    "language_model_only",
                    True,
                    f"the engine answers to {', '.join(vision_names) or 'image requests'} "
                    "(multimodal), and --language-model-only disables the vision tower, so image "
                    "requests would fail. On the owner's Spark MTP was 2.13x faster on code but needs "
                    "this flag, and the vision alias won (docs/incidents.md#mtp-vs-vision)",
                    "choose one: drop language_model_only (and MTP), or drop the vision alias and "
                    "multimodal and serve vision from another engine",
                    engine.name,
                )
            )
    return problems


def _timeouts(host: Host) -> list[Problem]:
    """systemd's start timeout must outlast the readiness helper, which says why a start failed."""
    timeout, budget = host.config.timeout_start_s, host.config.readiness_budget_s
    if timeout > budget:
        return []
    why = (
        f"TimeoutStartSec must exceed the readiness budget ({budget} s), or systemd kills the start "
        "before the helper can report why it failed"
    )
    fix = f"set timeout_start_s above {budget} (the shipped Spark inventory: 1200 against 1080)"
    return [Problem(host.name, "timeout_start_s", timeout, why, fix)]


def _cgroup_caps(host: Host) -> list[Problem]:
    cfg = host.config
    problems = []
    for engine in [None, *cfg.engines]:
        if engine is None:
            high, highest = cfg.memory_high_gib, cfg.memory_max_gib
        elif engine.memory_high_gib or engine.memory_max_gib:
            high, highest = cfg.memory_limits(engine)
        else:
            continue
        name = engine.name if engine else None
        if highest <= high:
            problems.append(
                Problem(
                    host.name,
                    "memory_max_gib",
                    highest,
                    f"MemoryMax must be above MemoryHigh ({high} GiB): MemoryHigh throttles first, "
                    "MemoryMax kills the unit last",
                    f"raise memory_max_gib above {high} or lower memory_high_gib",
                    name,
                )
            )
        if highest > cfg.memory_total_gib:
            problems.append(
                Problem(
                    host.name,
                    "memory_max_gib",
                    highest,
                    f"above the {cfg.memory_total_gib} GiB the host has, so the kernel's global OOM "
                    "killer would act before the unit's cap (docs/incidents.md#memory-ceiling)",
                    f"set memory_max_gib below memory_total_gib ({cfg.memory_total_gib})",
                    name,
                )
            )
    return problems


def _compile_storm(host: Host) -> list[Problem]:
    cfg = host.config
    peak = cfg.compile_caps.max_jobs * cfg.compiler_peak_gib
    if peak <= cfg.memory_headroom_gib:
        return []
    safe = max(1, int(cfg.memory_headroom_gib // cfg.compiler_peak_gib))
    return [
        Problem(
            host.name,
            "compile_caps.max_jobs",
            cfg.compile_caps.max_jobs,
            f"{cfg.compile_caps.max_jobs} compilers x {cfg.compiler_peak_gib} GiB = {peak:.1f} GiB "
            f"exceeds the {cfg.memory_headroom_gib} GiB headroom: a cold JIT cache would OOM the "
            "box (docs/incidents.md#compile-storm)",
            f"set compile_caps.max_jobs to at most {safe}",
        )
    ]


def _cpu_pool(host: Host) -> list[Problem]:
    if host.config.device != "cpu":
        return []
    return [
        Problem(
            host.name,
            "kv_cache_memory_bytes",
            None,
            "vLLM's CPU build cannot size its KV pool from a utilization and fails at start",
            "set kv_cache_memory_bytes (e.g. 268435456)",
            engine.name,
        )
        for engine in host.config.engines
        if engine.kv_cache_memory_bytes is None
    ]


def _native_window(host: Host) -> list[Problem]:
    problems = []
    for engine in host.config.engines:
        config = host.model_configs.get(engine.name)
        if config is None:
            continue
        native = modelconfig.geometry(config).native_max_len
        if native and engine.max_model_len > native:
            problems.append(
                Problem(
                    host.name,
                    "max_model_len",
                    engine.max_model_len,
                    f"above the checkpoint's native maximum of {native:,} tokens "
                    "(max_position_embeddings); vLLM refuses to start",
                    f"set max_model_len to at most {native}",
                    engine.name,
                )
            )
    return problems


def _memory_floors(host: Host) -> list[Problem]:
    cfg = host.config
    if cfg.memory_critical_gib < cfg.memory_warn_gib:
        return []
    return [
        Problem(
            host.name,
            "memory_critical_gib",
            cfg.memory_critical_gib,
            f"the critical floor must lie below the warning floor ({cfg.memory_warn_gib} GiB): "
            "the alert comes first, stopping an engine last",
            f"set memory_critical_gib below {cfg.memory_warn_gib}",
        )
    ]


def _wheelhouse(host: Host) -> list[Problem]:
    source = host.config.wheelhouse_source
    if source is None:
        return []
    if host.config.wheelhouse is None:
        return [
            Problem(
                host.name,
                "wheelhouse_source",
                source,
                "there is no host folder to copy the wheels into",
                "set wheelhouse to a folder on the host, e.g. /var/cache/sparkform/wheelhouse",
            )
        ]
    if not any(Path(source).expanduser().glob("*.whl")):
        return [
            Problem(
                host.name,
                "wheelhouse_source",
                source,
                "no wheel (*.whl) in that folder on this machine",
                "download them first: pip download --require-hashes --no-deps --only-binary=:all: -d FOLDER -r LOCK",
            )
        ]
    return []


def _lock(host: Host) -> list[Problem]:
    """Each venv installs exactly a complete hashed lock of its pinned vLLM: no lock, no venv.
    The host's own lock is checked, and each lock an engine names (`engines[].vllm_version` or
    `lock_file`), once, under the first engine that names it; a disabled engine's too, since its
    settings still name the venv of its lock."""
    cfg = host.config
    owners: dict[VllmPin, Engine | None] = {cfg.pin(): None}
    for engine in cfg.engines:
        owners.setdefault(cfg.pin(engine), engine)
    problems = []
    for pin, owner in owners.items():
        named = owner.lock_file if owner else cfg.lock_file
        # An engine that names a version only is told of that field, not of a lock it never named.
        field, value = ("lock_file", pin.lock) if named or owner is None else ("vllm_version", pin.version)
        fix = (
            f"make it with `{locks.lock_command(pin.package, pin.version, cfg.device)}` (docs/operator.md, Locks), "
            f"or point {'engines[].' if owner else ''}lock_file at a hashed lock of {pin.requirement}"
        )
        path = Path(pin.lock)
        if not path.is_file():
            missing = f"the repo has no lock for {pin.requirement} on {cfg.device}" if named is None else "no such file"
            problems.append(Problem(host.name, field, value, missing, fix, owner.name if owner else None))
        elif found := locks.lock_problems(path.read_text(), pin.package, pin.version):
            more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
            problems.append(
                Problem(host.name, field, value, "; ".join(found[:3]) + more, fix, owner.name if owner else None)
            )
    return problems


def _vllm_takes(host: Host) -> list[Problem]:
    """Each engine's quantization and KV cache dtype are ones its vLLM takes, where its code was
    read (sparkform.domain.vllm_versions): a method a version dropped (0.32 dropped bitsandbytes) would
    fail at engine start, after the deploy changed the host."""
    cfg = host.config
    problems = []
    for engine in cfg.enabled_engines:
        version = cfg.pin(engine).version
        if (known := vllm_versions.takes(version)) is None:
            continue
        for field, value, taken in (
            ("quantization", engine.quantization, known.quantizations),
            ("kv_cache_dtype", engine.kv_cache_dtype, known.kv_cache_dtypes),
        ):
            if value is not None and value not in taken:
                problems.append(
                    Problem(
                        host.name,
                        field,
                        value,
                        f"vLLM {version} takes no {field} {value!r} (read from its code): it would not start",
                        f"use one it takes ({', '.join(sorted(taken))}), or pin a vLLM that takes {value!r}",
                        engine.name,
                    )
                )
    return problems


def _spanning(host: Host) -> list[Problem]:
    """What this host needs for each engine that spans hosts (engines[].nodes): to be one of its
    nodes, the interface its rank talks over, on the head the address the workers meet at, one
    commit of the checkpoint for every rank, and the master port free here. The rules across the
    nodes are sparkform/rules/nodes.py's."""
    cfg = host.config
    problems = []
    for engine in cfg.engines:
        if not engine.nodes:
            continue
        if host.name not in engine.nodes:
            problems.append(
                Problem(
                    host.name,
                    "nodes",
                    engine.nodes,
                    "this host holds the engine but is none of its nodes",
                    f"add {host.name} to nodes, or take the engine off this host (keep a pair's engines in the data "
                    "of the group the pair shares)",
                    engine.name,
                )
            )
            continue
        if cfg.node_interface is None:
            problems.append(
                Problem(
                    host.name,
                    "node_interface",
                    None,
                    f"the engine spans {', '.join(engine.nodes)}: without the interface its ranks talk over, NCCL "
                    "and gloo pick one themselves (often the 10 GbE port, not the ConnectX-7)",
                    "set node_interface to this host's ConnectX-7 interface (`ip -br link`), e.g. enp1s0f1np1",
                    engine.name,
                )
            )
        if engine.head == host.name and cfg.node_address is None:
            problems.append(
                Problem(
                    host.name,
                    "node_address",
                    None,
                    "this host is the engine's head (rank 0): its workers meet it at this address (--master-addr)",
                    "set node_address to this host's address on node_interface",
                    engine.name,
                )
            )
        if not COMMIT_ID.fullmatch(engine.checkpoint.revision):
            problems.append(
                Problem(
                    host.name,
                    "checkpoint.revision",
                    engine.checkpoint.revision,
                    "a branch or tag is resolved by each host on its own, so the ranks could load two commits",
                    "pin the commit id (`sparkform plan --resolve` names the one the branch names now)",
                    engine.name,
                )
            )
        taken = _ports_in_use(cfg, engine)
        if engine.master_port in taken:
            problems.append(
                Problem(
                    host.name,
                    "master_port",
                    engine.master_port,
                    f"{taken[engine.master_port]} uses this port on this host",
                    "give master_port a port no other service of this host uses",
                    engine.name,
                )
            )
    return problems


def _ports_in_use(cfg: HostConfig, spanning: Engine) -> dict[int, str]:
    """Every port this host serves on, but `spanning`'s master port: port -> what uses it."""
    taken = {}
    if cfg.monitoring.enabled:
        taken[cfg.monitoring.port] = "node_exporter"
    for engine in cfg.engines:
        taken[engine.port] = f"engine {engine.name}'s port"
        if engine.nodes and engine is not spanning:
            taken[engine.master_port] = f"engine {engine.name}'s master_port"
    return taken
