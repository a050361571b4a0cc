"""Memory planner: what each engine's share of unified memory buys in KV cache and concurrency.

vLLM sizes an engine's KV pool at boot from its utilization: pool = share - weights - non-KV
workspace. Context length is a per-request ceiling, not a reservation
(docs/incidents.md#window-raise), so concurrency at the window is pool tokens / max_model_len.
Tokens per GiB is architectural and differs tenfold between a Mamba hybrid and a dense-attention
model, so an even split starves one engine; the recommended split equalises concurrency at each
engine's window instead (docs/incidents.md#even-split). From config.json the pool follows vLLM's
paging (modelconfig.KvLayout): whole blocks, and on a hybrid one state block per request, which
is why its tokens per GiB grow with the window (docs/incidents.md#kv-pool-ledger).

An engine that spans hosts (engines[].nodes) is planned on each of its nodes: one tensor-parallel
rank holds weights / TP and its part of the KV pool (its share of the KV heads and states) plus
the workspace, within that host's share; its tokens per GiB count the whole engine's tokens per
GiB of one rank's pool, so the pool and the concurrency are the engine's (docs/two-sparks.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from sparkform.domain import modelconfig
from sparkform.domain.engine import Engine
from sparkform.domain.model import Host, Problem
from sparkform.domain.modelconfig import GIB, KvLayout

# The schema's bound on gpu_memory_utilization.
MAX_UTILIZATION = next(
    bound.le for bound in Engine.model_fields["gpu_memory_utilization"].metadata if hasattr(bound, "le")
)


@dataclass(frozen=True)
class EnginePlan:
    name: str
    utilization: float
    share_gib: float
    weights_gib: float | None
    non_kv_gib: float | None
    kv_gib: float | None
    kv_source: str
    tokens_per_gib: float | None
    tokens_source: str
    max_model_len: int
    max_num_seqs: int
    state_blocks: int | None  # hybrids: sequences the pool can hold state for
    layout: KvLayout | None  # vLLM's paging of one rank, from config.json, when the tokens come from it
    tensor_parallel: int = 1  # ranks, one per node; the figures above are this node's
    kind: str = "generate"  # a pooling engine (embed, score, rerank) keeps its share out of the split

    @property
    def pool_tokens(self) -> int | None:
        if self.kv_gib is None:
            return None
        if self.layout is not None:
            return self.layout.pool_tokens(self.kv_gib * GIB)
        if self.tokens_per_gib is None:
            return None
        # round, not int: a measured pool (tokens / GiB x GiB) must come back exact, not one short.
        return round(self.kv_gib * self.tokens_per_gib)

    @property
    def concurrency(self) -> float | None:
        pool = self.pool_tokens
        return None if pool is None else pool / self.max_model_len


@dataclass(frozen=True)
class Split:
    """A recommended utilization per engine, with what it would buy."""

    utilization: dict[str, float]
    concurrency: dict[str, float]


@dataclass(frozen=True)
class Plan:
    host: str
    memory_total_gib: float
    headroom_gib: float
    engines: list[EnginePlan]
    split: Split | None
    split_note: str

    @property
    def used_gib(self) -> float:
        return sum(engine.share_gib for engine in self.engines)

    @property
    def free_gib(self) -> float:
        return self.memory_total_gib - self.used_gib

    def as_dict(self) -> dict:
        return {
            "host": self.host,
            "memory_total_gib": self.memory_total_gib,
            "headroom_gib": self.headroom_gib,
            "used_gib": self.used_gib,
            "free_gib": self.free_gib,
            "engines": [asdict(e) | {"pool_tokens": e.pool_tokens, "concurrency": e.concurrency} for e in self.engines],
            "split": asdict(self.split) if self.split else None,
            "split_note": self.split_note,
        }


def _layout(host: Host, engine: Engine) -> KvLayout | None:
    config = host.model_configs.get(engine.name)
    if config is None:
        return None
    kv_bytes = modelconfig.kv_dtype_bytes(engine.kv_cache_dtype, config)
    return modelconfig.geometry(config).rank(engine.tensor_parallel_size).layout(kv_bytes, engine.max_model_len)


def _tokens_per_gib(host: Host, engine: Engine, layout: KvLayout | None) -> tuple[float | None, str]:
    if engine.measured.tokens_per_gib:
        return engine.measured.tokens_per_gib, "measured"
    if layout is not None:
        return layout.tokens_per_gib, "config.json"
    config = host.model_configs.get(engine.name)
    if config is None:
        return None, "unknown: set model_config_path or measured"
    # A hybrid without its state's dimensions: per-token KV alone, which ignores the state blocks.
    geometry = modelconfig.geometry(config).rank(engine.tensor_parallel_size)
    per_gib = geometry.tokens_per_gib(modelconfig.kv_dtype_bytes(engine.kv_cache_dtype, config))
    return per_gib, "config.json (upper bound: no state dimensions)"


def node_weights_gib(engine: Engine) -> float | None:
    """The weights one node holds: all of them on one host, weights / TP for each rank."""
    return None if engine.weights_gib is None else engine.weights_gib / engine.tensor_parallel_size


def _kv_gib(engine: Engine, share_gib: float) -> tuple[float | None, float | None, str]:
    """(kv_gib, non_kv_gib, source) for an engine at its configured share, on one of its nodes
    (a measured figure is one rank's, as each rank's boot log prints it)."""
    if engine.kv_cache_memory_bytes:
        return engine.kv_cache_memory_bytes / GIB, None, "kv_cache_memory_bytes"
    measured = engine.measured
    if measured.kv_cache_gib:
        measured_util = measured.gpu_memory_utilization or engine.gpu_memory_utilization
        # Weights and workspace do not move with the utilization; the pool takes the difference.
        non_kv = share_gib / engine.gpu_memory_utilization * measured_util - measured.kv_cache_gib
        source = (
            "measured"
            if measured_util == engine.gpu_memory_utilization
            else f"measured at {measured_util:.2f}, re-derived"
        )
        return max(share_gib - non_kv, 0.0), non_kv, source
    weights = node_weights_gib(engine)
    if weights is not None:
        non_kv = weights + engine.non_kv_overhead_gib
        return max(share_gib - non_kv, 0.0), non_kv, "share - weights - overhead"
    return None, None, "unknown: set weights_gib or measured.kv_cache_gib"


def engine_plan(host: Host, engine: Engine) -> EnginePlan:
    share = engine.gpu_memory_utilization * host.config.memory_total_gib
    kv_gib, non_kv, kv_source = _kv_gib(engine, share)
    layout = _layout(host, engine)
    # Measured tokens per GiB outrank the paging; the Mamba cache blocks still come from it.
    paging = None if engine.measured.tokens_per_gib else layout
    per_gib, tokens_source = _tokens_per_gib(host, engine, paging)
    # vLLM's "Mamba cache blocks": every block of a hybrid's pool can hold one sequence's state.
    state_blocks = layout.blocks(kv_gib * GIB) if layout and layout.state_groups and kv_gib is not None else None
    return EnginePlan(
        engine.name,
        engine.gpu_memory_utilization,
        share,
        node_weights_gib(engine),
        non_kv,
        kv_gib,
        kv_source,
        per_gib,
        tokens_source,
        engine.max_model_len,
        engine.max_num_seqs,
        state_blocks,
        paging,
        engine.tensor_parallel_size,
        engine.kind,
    )


def state_block_problems(host: Host) -> list[Problem]:
    """max_num_seqs above the state blocks a hybrid's pool holds: vLLM refuses CUDA graph
    capture ("max_num_seqs (256) exceeds available Mamba cache blocks (147)",
    docs/incidents.md#mamba-max-num-seqs)."""
    problems = []
    for engine in host.config.enabled_engines:
        blocks = engine_plan(host, engine).state_blocks
        # An empty pool is no max_num_seqs problem: the plan shows it (KV GiB 0).
        if blocks and engine.max_num_seqs > blocks:
            problems.append(
                Problem(
                    host.name,
                    "max_num_seqs",
                    engine.max_num_seqs,
                    f"above the {blocks} Mamba cache blocks the planner predicts for this pool (each "
                    "decoding sequence holds one); vLLM would refuse CUDA graph capture at start",
                    f"lower max_num_seqs to at most {blocks} or raise gpu_memory_utilization",
                    engine.name,
                )
            )
    return problems


def node_memory_problems(host: Host) -> list[Problem]:
    """A rank of an engine that spans hosts must hold its part of the weights, its workspace and
    (when pinned) its KV pool within this node's share: a node over it fails the engine on every
    node, after both cold starts. (An engine of one host keeps its old rule: the plan shows an empty
    pool.)"""
    problems = []
    for engine in host.config.enabled_engines:
        if not engine.nodes:
            continue
        node = engine_plan(host, engine)
        pinned = engine.kv_cache_memory_bytes / GIB if engine.kv_cache_memory_bytes else 0.0
        non_kv = node.non_kv_gib
        if non_kv is None and node.weights_gib is not None:  # a pinned pool: the plan left the weights out
            non_kv = node.weights_gib + engine.non_kv_overhead_gib
        if non_kv is None or non_kv + pinned <= node.share_gib + 1e-9:
            continue
        need = non_kv + pinned
        parts = f"{non_kv:.2f} GiB of weights and workspace" + (
            f" + {pinned:.2f} GiB of pinned KV pool" if pinned else ""
        )
        if node.weights_gib is not None:
            parts += f" (weights {engine.weights_gib:.2f} GiB / {node.tensor_parallel} nodes = {node.weights_gib:.2f})"
        total = host.config.memory_total_gib
        problems.append(
            Problem(
                host.name,
                "gpu_memory_utilization",
                engine.gpu_memory_utilization,
                f"this node's rank needs {parts}, over its share of {engine.gpu_memory_utilization:.2f} x "
                f"{total:.1f} GiB = {node.share_gib:.2f} GiB",
                _node_fix(math.ceil(need / total * 100) / 100),
                engine.name,
            )
        )
    return problems


def _node_fix(utilization: float) -> str:
    if utilization <= MAX_UTILIZATION:
        return f"raise gpu_memory_utilization to at least {utilization:.2f} on every node, or span more nodes"
    return f"a rank would need {utilization:.2f} of this node (at most {MAX_UTILIZATION}): span more nodes"


def recommend_split(plans: list[EnginePlan], total_gib: float) -> tuple[Split | None, str]:
    """Same total share, divided so every engine holds the same full-window concurrency.

    Each engine's share is its fixed non-KV cost plus c full-length requests of KV:
    u_i * T = n_i + c * L_i / t_i, and sum(u_i) stays what the inventory gives. Only generators
    share: a pooling engine's requests are single prompts, so its share is what its own
    max_num_seqs x max_model_len needs, not concurrency to trade.
    """
    plans = [p for p in plans if p.kind == "generate"]
    if len(plans) < 2:
        return None, "one generating engine: nothing to split"
    non_kv = {p.name: p.non_kv_gib for p in plans if p.non_kv_gib is not None}
    tokens_per_gib = {p.name: p.tokens_per_gib for p in plans if p.tokens_per_gib is not None}
    if len(non_kv) < len(plans) or len(tokens_per_gib) < len(plans):
        return None, "needs each engine's non-KV size and tokens per GiB (weights_gib or measured)"
    budget = sum(p.share_gib for p in plans)
    gib_per_request = {p.name: p.max_model_len / tokens_per_gib[p.name] for p in plans}
    fixed = sum(non_kv.values())
    if budget <= fixed:
        return None, "the shares do not even hold the engines' weights"
    target = (budget - fixed) / sum(gib_per_request.values())

    def concurrency_at(p: EnginePlan, util: float) -> float:
        return (util * total_gib - non_kv[p.name]) / gib_per_request[p.name]

    utilization = {p.name: round((non_kv[p.name] + target * gib_per_request[p.name]) / total_gib, 2) for p in plans}
    # Rounding must not grow the total: take the excess from whoever keeps the most concurrency.
    while sum(utilization.values()) > budget / total_gib + 1e-9:
        richest = max(plans, key=lambda p: concurrency_at(p, utilization[p.name] - 0.01))
        utilization[richest.name] = round(utilization[richest.name] - 0.01, 2)
    concurrency = {p.name: concurrency_at(p, utilization[p.name]) for p in plans}
    return Split(utilization, concurrency), "equal concurrency at each engine's max_model_len"


def plan(host: Host) -> Plan:
    cfg = host.config
    plans = [engine_plan(host, engine) for engine in cfg.enabled_engines]
    split, note = recommend_split(plans, cfg.memory_total_gib)
    return Plan(host.name, cfg.memory_total_gib, cfg.memory_headroom_gib, plans, split, note)


def _fmt(value: float | int | None, spec: str) -> str:
    return "?" if value is None else format(value, spec)


def _aligned(row: Sequence[str], widths: list[int]) -> list[str]:
    """The first cell left-aligned, the figures right-aligned."""
    return [cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))]


def format_plan(result: Plan) -> str:
    header = (
        "engine",
        "util",
        "share GiB",
        "weights GiB",
        "non-KV GiB",
        "KV GiB",
        "tok/GiB",
        "KV pool tok",
        "window",
        "concurrency",
    )
    rows = [header]
    for e in result.engines:
        rows.append(
            (
                e.name,
                f"{e.utilization:.2f}",
                f"{e.share_gib:.2f}",
                _fmt(e.weights_gib, ".2f"),
                _fmt(e.non_kv_gib, ".2f"),
                _fmt(e.kv_gib, ".2f"),
                _fmt(e.tokens_per_gib, ",.0f"),
                _fmt(e.pool_tokens, ","),
                f"{e.max_model_len:,}",
                "?" if e.concurrency is None else f"{e.concurrency:.2f}x",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [f"host {result.host}: {result.memory_total_gib:.1f} GiB unified memory"]
    lines += ["  " + "  ".join(_aligned(row, widths)) for row in rows]
    lines.append(
        f"  engines take {result.used_gib:.2f} GiB; {result.free_gib:.2f} GiB stays free "
        f"(headroom asked: {result.headroom_gib:.1f} GiB)"
    )
    for e in result.engines:
        blocks = (
            ""
            if e.state_blocks is None
            else f"; {e.state_blocks:,} Mamba cache blocks for max_num_seqs {e.max_num_seqs}"
        )
        paging = ""
        if e.layout is not None:
            block, per_request = e.layout.block_tokens, e.layout.blocks_per_request
            paging = f" (blocks of {block:,} tokens, {per_request:,} per full-window request)"
        ranks = (
            ""
            if e.tensor_parallel == 1
            else f"; this node is one of {e.tensor_parallel} tensor-parallel ranks (its GiB, the engine's tokens)"
        )
        pooling = "" if e.kind == "generate" else f"; a pooling engine ({e.kind}): prompts only, no generation"
        lines.append(
            f"  {e.name}: KV from {e.kv_source}; tokens/GiB from {e.tokens_source}{paging}{blocks}{ranks}{pooling}"
        )
    if result.split:
        parts = ", ".join(
            f"{name} {util:.2f} ({result.split.concurrency[name]:.2f}x)"
            for name, util in result.split.utilization.items()
        )
        lines.append(f"  recommended split ({result.split_note}): {parts}")
    else:
        lines.append(f"  recommended split: none ({result.split_note})")
    return "\n".join(lines)
