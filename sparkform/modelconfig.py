"""KV-cache geometry of a checkpoint, from its config.json, by vLLM's page rules.

Only layers that keep per-token KV (full attention) cost memory per token; Mamba and linear
attention layers keep a constant state per sequence instead. That is why a Mamba hybrid gets
ten times the tokens per GiB of a dense-attention model (docs/incidents.md#even-split).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 1024**3

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
        # K and V of every full-attention layer (tensor parallel 1, as on a Spark).
        return self.kv_layers * self.kv_heads * 2 * self.head_dim * kv_dtype_bytes

    def tokens_per_gib(self, kv_dtype_bytes: float) -> float:
        return GIB / self.bytes_per_token(kv_dtype_bytes)

    @property
    def is_hybrid(self) -> bool:
        return self.state_layers > 0

    def state_blocks(self, kv_bytes: float, kv_dtype_bytes: float) -> int | None:
        """Cache blocks of a hybrid's pool, each holding one sequence's state (vLLM's "Mamba
        cache blocks", which bound max_num_seqs). An estimate by vLLM's rules: the attention
        block grows until one page holds a state; layers share blocks in groups the size of the
        smaller layer kind. None when config.json lacks the state's dimensions."""
        if not self.is_hybrid or not self.state_bytes_per_layer:
            return None
        token_bytes = self.kv_heads * 2 * self.head_dim * kv_dtype_bytes
        block_tokens = max(16, math.ceil(self.state_bytes_per_layer / token_bytes / 16) * 16)
        group_size = min(self.kv_layers, self.state_layers)
        return int(kv_bytes // (block_tokens * token_bytes * group_size))


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
    """Conv state plus SSM/recurrent state of one layer for one sequence, in the model dtype."""
    dtype = DTYPE_BYTES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"), 2)
    if "mamba_num_heads" in cfg:  # Nemotron-H, Mamba-2
        inner = cfg["mamba_num_heads"] * cfg["mamba_head_dim"]
        conv_dim = inner + 2 * cfg.get("n_groups", 1) * cfg["ssm_state_size"]
        return int(((cfg.get("conv_kernel", 4) - 1) * conv_dim + inner * cfg["ssm_state_size"]) * dtype)
    if "linear_num_value_heads" in cfg:  # Qwen3-Next / Qwen3.5, Gated DeltaNet
        key_dim = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
        value_dim = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
        recurrent = cfg["linear_num_value_heads"] * cfg["linear_key_head_dim"] * cfg["linear_value_head_dim"]
        conv = (cfg.get("linear_conv_kernel_dim", 4) - 1) * (2 * key_dim + value_dim)
        return int((conv + recurrent) * dtype)
    return None


def kv_dtype_bytes(kv_cache_dtype: str, config: dict[str, Any]) -> float:
    """Bytes per KV element: the cache dtype, or the model's dtype when it is 'auto'."""
    if kv_cache_dtype != "auto":
        return DTYPE_BYTES[kv_cache_dtype]
    cfg = _text_config(config)
    model_dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return DTYPE_BYTES.get(model_dtype, 2)


def load(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelConfigError(f"{path} does not exist") from None
    except json.JSONDecodeError as err:
        raise ModelConfigError(f"{path} is not valid JSON ({err})") from None
