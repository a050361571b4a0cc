"""The owner's DGX Spark: the pair resident at once, q38 started after nemotron is ready, and bge-m3 after both.

    pyinfra inventory/spark.py deploy.py --dry --diff   # look first
    pyinfra inventory/spark.py deploy.py                # converge
    sparkform plan inventory/spark.py                   # memory plan, no connection

SPARK_HOST and SPARK_USER pick the box and the SSH user; every other value is the owner's served
pair (docs/incidents.md#the-served-pair). The pair serves the LAN, so the
front requires an API key: write one before the first run (docs/security.md):

    mkdir -p ~/.config/sparkform && (umask 077; openssl rand -hex 32 > ~/.config/sparkform/spark-api-key)

SPARK_API_KEY_FILE points elsewhere; SPARK_LISTEN_ADDRESS=127.0.0.1 keeps the models on the box.
The Spark's SSH host key is pinned in ~/.config/sparkform/known_hosts (SPARK_KNOWN_HOSTS points
elsewhere), recorded once as docs/security.md ("Pinned host keys") says.

`sparkform init` writes a copy of this file for another Spark: the block marked for it below
holds its options' values there, and the copy serves the pair alone.
"""

import os
from typing import Any

from sparkform.inventory import hosts

# >>> sparkform init: in the copy it writes, each name below holds a literal (an option's value, or
# the default here) and reads no variable (sparkform/commands/init.py).
HOST = os.environ.get("SPARK_HOST", "spark.local")
SSH_USER = os.environ.get("SPARK_USER", "root")
# The Spark's host key, recorded once (docs/security.md, "Pinned host keys"): `sparkform rebuild`
# connects unattended after a reboot and must never trust a key it first sees then.
KNOWN_HOSTS_FILE = os.environ.get("SPARK_KNOWN_HOSTS", "~/.config/sparkform/known_hosts")
# A gated checkpoint needs a Hugging Face token, e.g. in ~/.config/sparkform/hf-token.
HF_TOKEN_FILE = os.environ.get("SPARK_HF_TOKEN_FILE")
LISTEN_ADDRESS = os.environ.get("SPARK_LISTEN_ADDRESS", "0.0.0.0")
API_KEY_FILE = os.environ.get("SPARK_API_KEY_FILE", "~/.config/sparkform/spark-api-key")
# The pair: the fast one for the agents' tool loops, the careful one for long contexts and hard code.
FAST_NAME = "nemotron"
FAST_MODEL = "nvidia/Nemotron-3.5-Lightning-30B-A3B-NVFP4"
FAST_PORT = 8012
CAREFUL_NAME = "q38"
CAREFUL_MODEL = "RedHatAI/Qwen3.8-27B-NVFP4"
CAREFUL_PORT = 8011
EMBEDDING = True  # the agents' embedding engine beside the pair (EMBED below)
# <<< sparkform init

TOOL_PARSER = "qwen3_xml"

# What each checkpoint of the served pair needs beyond its role's settings, and its pool as the
# owner's Spark measured it. Another checkpoint starts without: set its parsers as its model card
# says, and `measured` once it served (`sparkform ledger` shows it).
CHECKPOINT_SETTINGS: dict[str, dict[str, Any]] = {
    # The fast "hands": a Mamba hybrid, ~305K KV tokens per GiB.
    "nvidia/Nemotron-3.5-Lightning-30B-A3B-NVFP4": {
        "quantization": "modelopt",
        "tool_call_parser": TOOL_PARSER,
        "reasoning_parser": "nemotron_v3",
        # Boot log at the 262,144 window (docs/incidents.md#kv-pool-ledger).
        "measured": {
            "gpu_memory_utilization": 0.25,
            "kv_cache_gib": 8.26,
            "kv_pool_tokens": 2_703_604,
            "cold_start_s": 200,
        },
    },
    # The careful "eyes": dense attention, ~31K KV tokens per GiB; it answers to the vision alias,
    # so it cannot run MTP (docs/incidents.md#mtp-vs-vision).
    "RedHatAI/Qwen3.8-27B-NVFP4": {
        "quantization": "compressed-tensors",
        "served_names": ["vision"],  # after the engine's own name
        "multimodal": True,
        "tool_call_parser": TOOL_PARSER,
        # The checkpoint ships thinking-mode sampling as server defaults.
        "generation_config": "vllm",
        "weights_gib": 21.81,
        "measured": {
            "gpu_memory_utilization": 0.45,
            "kv_cache_gib": 26.8,
            "kv_pool_tokens": 858_483,
            "cold_start_s": 335,
        },
    },
}


def engine(name: str, repo: str, port: int, settings: dict) -> dict:
    """An engine of the pair: its name, port and checkpoint, its role's settings, then what its
    checkpoint needs. It answers to its own name first, then to its checkpoint's aliases."""
    needs = CHECKPOINT_SETTINGS.get(repo, {})
    return {
        "name": name,
        "port": port,
        "checkpoint": {"repo": repo, "revision": "main"},
        **settings,
        **needs,
        "served_names": [name, *needs.get("served_names", [])],
    }


EMBED = {
    # The agents' embedding model: ordered after both drivers (the helper's race with
    # their warm-up cost it a CUDA OOM once), and still on the vLLM 0.21.0 it has run
    # since May, in a venv of its own (docs/operator.md, "A vLLM per engine").
    "name": "embed",
    "kind": "embed",
    "port": 8004,
    "checkpoint": {"repo": "BAAI/bge-m3", "revision": "main"},
    "vllm_version": "0.21.0",
    "gpu_memory_utilization": 0.05,
    "max_model_len": 8192,
    "max_num_seqs": 32,
    "after": [FAST_NAME, CAREFUL_NAME],
    "weights_gib": 1.06,
}

spark = hosts(
    {
        HOST: {
            "ssh_user": SSH_USER,
            "ssh_known_hosts_file": KNOWN_HOSTS_FILE,
            "ssh_strict_host_key_checking": "yes",
            "_sudo": SSH_USER != "root",  # another user runs the deploy's commands with sudo
            "vllm_version": "0.27.1",
            "hf_token_file": HF_TOKEN_FILE,
            "listen_address": LISTEN_ADDRESS,
            "api_key_file": API_KEY_FILE,
            "engines": [
                engine(
                    FAST_NAME,
                    FAST_MODEL,
                    FAST_PORT,
                    {
                        "gpu_memory_utilization": 0.25,
                        "max_model_len": 262_144,
                        # Not a memory knob: each decode sequence needs one Mamba state block, and
                        # the default 256 exceeded a pool's 147 (CUDA graph capture refused; by the
                        # page rules Qwen3.8's at the even split: docs/incidents.md#mamba-max-num-seqs).
                        "max_num_seqs": 128,
                    },
                ),
                engine(
                    CAREFUL_NAME,
                    CAREFUL_MODEL,
                    CAREFUL_PORT,
                    {
                        "gpu_memory_utilization": 0.45,
                        "max_model_len": 262_144,
                        "max_num_seqs": 128,
                        # Started once the fast one serves: two cold starts at once do not fit.
                        "after": [FAST_NAME],
                    },
                ),
                *([EMBED] if EMBEDDING else []),
            ],
        }
    },
    __file__,
)
