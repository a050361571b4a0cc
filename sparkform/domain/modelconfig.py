"""KV-cache geometry of a checkpoint, from its config.json, by vLLM's page rules.

Only layers that keep per-token KV (full attention) cost memory per token; Mamba and linear
attention layers keep a constant state per sequence instead. That is why a Mamba hybrid gets
ten times the tokens per GiB of a dense-attention model (docs/incidents.md#even-split).

How vLLM turns KV memory into a pool (vllm/v1/core/kv_cache_utils.py, the hybrid page rules of
vllm/model_executor/models/config.py) is `KvLayout`: one page size for every layer, the
attention block grown until its page holds a sequence's state, layers in groups that share a
block id, and a full-window request costing its attention blocks plus one block per state group
(docs/incidents.md#kv-pool-ledger).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

GIB = 1024**3

# vLLM's default block for attention-only models, and the multiple a hybrid's grown attention
# block is rounded up to (the kernels' block alignment).
BLOCK_TOKENS = 16

DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "nvfp4": 0.5,
}


class ModelConfigError(ValueError):
    """config.json lacks what the KV arithmetic needs."""


@dataclass(frozen=True)
class KvLayout:
    """How vLLM pages one checkpoint's KV pool at one window.

    A block id spans one page in each of the layers that share it (one layer per group), so the
    pool holds kv_bytes // block_bytes blocks. A request at the full window takes
    ceil(window / block_tokens) blocks in each attention group and one block (its state) in each
    Mamba / linear-attention group; vLLM prints concurrency as blocks / that, and the pool in
    tokens as concurrency x window."""

    block_tokens: int  # tokens per attention block
    block_bytes: int  # one block id: page size x layers per group
    blocks_per_request: int  # a full-window request
    max_model_len: int
    state_groups: int  # groups of Mamba / linear-attention layers; 0 for attention-only models

    def blocks(self, kv_bytes: float) -> int:
        return int(kv_bytes // self.block_bytes)

    def pool_tokens(self, kv_bytes: float) -> int:
        return self.blocks(kv_bytes) * self.max_model_len // self.blocks_per_request

    @property
    def tokens_per_gib(self) -> float:
        """Pool tokens per GiB at this window, before the pool is cut to whole blocks."""
        return GIB * self.max_model_len / (self.blocks_per_request * self.block_bytes)


@dataclass(frozen=True)
class KvGeometry:
    """What one sequence costs in cache: per token (attention layers), per sequence (state)."""

    architecture: str
    num_layers: int
    kv_layers: int  # layers that hold per-token KV
    state_layers: int  # Mamba / linear-attention layers: constant state per sequence
    kv_heads: int
    head_dim: int
    native_max_len: int | None
    state_bytes_per_layer: int | None = None  # one sequence's Mamba/linear-attention state

    def bytes_per_token(self, kv_dtype_bytes: float) -> float:
        # K and V of every full-attention layer (tensor parallel 1, as on one Spark; `rank` for more).
        return self.kv_layers * self.kv_heads * 2 * self.head_dim * kv_dtype_bytes

    def tokens_per_gib(self, kv_dtype_bytes: float) -> float:
        """Per-token KV alone: exact for attention-only models, an upper bound for hybrids."""
        return GIB / self.bytes_per_token(kv_dtype_bytes)

    def rank(self, tensor_parallel: int) -> KvGeometry:
        """What one of `tensor_parallel` ranks caches: its share of the KV heads (a head is copied
        to every rank when there are fewer heads than ranks) and of each state."""
        if tensor_parallel == 1:
            return self
        return replace(
            self,
            kv_heads=-(-self.kv_heads // tensor_parallel),
            state_bytes_per_layer=self.state_bytes_per_layer and -(-self.state_bytes_per_layer // tensor_parallel),
        )

    @property
    def is_hybrid(self) -> bool:
        return self.state_layers > 0

    def layout(self, kv_dtype_bytes: float, max_model_len: int) -> KvLayout | None:
        """vLLM's paging of this checkpoint at a window; None for a hybrid whose config.json lacks
        the state's dimensions."""
        token_bytes = self.kv_heads * 2 * self.head_dim * kv_dtype_bytes  # one layer's K and V
        if not self.is_hybrid:
            block, group_size, attention_groups = BLOCK_TOKENS, self.kv_layers, 1
        elif not self.state_bytes_per_layer:
            return None
        else:
            # The attention block grows until its page holds one state; states are padded to it.
            block = BLOCK_TOKENS * math.ceil(self.state_bytes_per_layer / (BLOCK_TOKENS * token_bytes))
            # Groups the size of the smaller layer kind (the larger when they are within 1.5x).
            fewer, more = sorted((self.kv_layers, self.state_layers))
            group_size = more if more < 1.5 * fewer else fewer
            attention_groups = math.ceil(self.kv_layers / group_size)
        state_groups = math.ceil(self.state_layers / group_size)
        return KvLayout(
            block_tokens=block,
            block_bytes=int(block * token_bytes) * group_size,
            blocks_per_request=math.ceil(max_model_len / block) * attention_groups + state_groups,
            max_model_len=max_model_len,
            state_groups=state_groups,
        )


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    # Multimodal checkpoints keep the language model's numbers under text_config.
    return {**config, **config.get("text_config", {})}


def geometry(config: dict[str, Any]) -> KvGeometry:
    cfg = _text_config(config)
    arch = (cfg.get("architectures") or ["unknown"])[0]
    try:
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    except KeyError as missing:
        raise ModelConfigError(f"config.json of {arch} has no {missing.args[0]!r}") from None

    pattern = cfg.get("hybrid_override_pattern")
    layer_types = cfg.get("layer_types")
    if pattern:
        # Nemotron-H: '*' attention, 'M' Mamba-2, '-' MLP, 'E' MoE.
        num_layers = len(pattern)
        kv_layers = pattern.count("*")
        state_layers = pattern.count("M")
    elif layer_types:
        # Qwen3-Next / Qwen3.5: full_attention vs linear_attention (Gated DeltaNet).
        num_layers = len(layer_types)
        kv_layers = sum(1 for kind in layer_types if kind == "full_attention")
        state_layers = sum(1 for kind in layer_types if kind in ("linear_attention", "mamba"))
    else:
        try:
            num_layers = int(cfg["num_hidden_layers"])
        except KeyError:
            raise ModelConfigError(f"config.json of {arch} has no 'num_hidden_layers'") from None
        kv_layers, state_layers = num_layers, 0
    if kv_layers == 0:
        raise ModelConfigError(f"config.json of {arch} has no full-attention layer")
    native = cfg.get("max_position_embeddings")
    return KvGeometry(
        arch,
        num_layers,
        kv_layers,
        state_layers,
        kv_heads,
        head_dim,
        int(native) if native else None,
        _state_bytes_per_layer(cfg),
    )


def _state_bytes_per_layer(cfg: dict[str, Any]) -> int | None:
    """Conv state plus SSM/recurrent state of one layer for one sequence. The conv state is in
    the model dtype; the SSM state in vLLM's mamba_ssm_cache_dtype, which 'auto' takes from
    config.json (Nemotron-H: mamba_ssm_cache_dtype, float32 when absent; Qwen3.5:
    mamba_ssm_dtype, the model dtype when absent)."""
    dtype = DTYPE_BYTES.get(_model_dtype(cfg), 2)
    if "mamba_num_heads" in cfg:  # Nemotron-H, Mamba-2
        ssm_dtype = DTYPE_BYTES.get(str(cfg.get("mamba_ssm_cache_dtype", "float32")), 4)
        inner = cfg["mamba_num_heads"] * cfg["mamba_head_dim"]
        conv_dim = inner + 2 * cfg.get("n_groups", 1) * cfg["ssm_state_size"]
        conv = (cfg.get("conv_kernel", 4) - 1) * conv_dim
        return int(conv * dtype + inner * cfg["ssm_state_size"] * ssm_dtype)
    if "linear_num_value_heads" in cfg:  # Qwen3-Next / Qwen3.5, Gated DeltaNet
        ssm_dtype = DTYPE_BYTES.get(str(cfg.get("mamba_ssm_dtype")), dtype)
        key_dim = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
        value_dim = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
        recurrent = cfg["linear_num_value_heads"] * cfg["linear_key_head_dim"] * cfg["linear_value_head_dim"]
        conv = (cfg.get("linear_conv_kernel_dim", 4) - 1) * (2 * key_dim + value_dim)
        return int(conv * dtype + recurrent * ssm_dtype)
    return None


def _model_dtype(cfg: dict[str, Any]) -> str:
    return str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")


def kv_dtype_bytes(kv_cache_dtype: str, config: dict[str, Any]) -> float:
    """Bytes per KV element: the cache dtype, or the model's dtype when it is 'auto'."""
    if kv_cache_dtype != "auto":
        return DTYPE_BYTES[kv_cache_dtype]
    return DTYPE_BYTES.get(_model_dtype(_text_config(config)), 2)


def load(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelConfigError(f"{path} does not exist") from None
    except json.JSONDecodeError as err:
        raise ModelConfigError(f"{path} is not valid JSON ({err})") from None
