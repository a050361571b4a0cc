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
"""

import os

from sparkform.inventory import hosts

TOOL_PARSER = "qwen3_xml"

spark = hosts(
    {
        os.environ.get("SPARK_HOST", "spark.local"): {
            "ssh_user": os.environ.get("SPARK_USER", "root"),
            # The Spark's host key, recorded once (docs/security.md, "Pinned host keys"): `sparkform rebuild`
            # connects unattended after a reboot and must never trust a key it first sees then.
            "ssh_known_hosts_file": os.environ.get("SPARK_KNOWN_HOSTS", "~/.config/sparkform/known_hosts"),
            "ssh_strict_host_key_checking": "yes",
            "_sudo": os.environ.get("SPARK_USER", "root") != "root",
            "vllm_version": "0.27.1",
            "hf_token_file": os.environ.get("SPARK_HF_TOKEN_FILE"),
            "listen_address": os.environ.get("SPARK_LISTEN_ADDRESS", "0.0.0.0"),
            "api_key_file": os.environ.get("SPARK_API_KEY_FILE", "~/.config/sparkform/spark-api-key"),
            "engines": [
                {
                    # The fast "hands": a Mamba hybrid, ~305K KV tokens per GiB.
                    "name": "nemotron",
                    "port": 8012,
                    "checkpoint": {"repo": "nvidia/Nemotron-3.5-Lightning-30B-A3B-NVFP4", "revision": "main"},
                    "quantization": "modelopt",
                    "gpu_memory_utilization": 0.25,
                    "max_model_len": 262_144,
                    # Not a memory knob: each decode sequence needs one Mamba state block, and
                    # the default 256 exceeded a pool's 147 (CUDA graph capture refused; by the
                    # page rules Qwen3.8's at the even split: docs/incidents.md#mamba-max-num-seqs).
                    "max_num_seqs": 128,
                    "served_names": ["nemotron"],
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
                {
                    # The careful "eyes": dense attention, ~31K KV tokens per GiB; it answers
                    # to the vision alias, so it cannot run MTP (docs/incidents.md#mtp-vs-vision).
                    "name": "q38",
                    "port": 8011,
                    "checkpoint": {"repo": "RedHatAI/Qwen3.8-27B-NVFP4", "revision": "main"},
                    "quantization": "compressed-tensors",
                    "gpu_memory_utilization": 0.45,
                    "max_model_len": 262_144,
                    "max_num_seqs": 128,
                    "served_names": ["q38", "vision"],
                    "multimodal": True,
                    "tool_call_parser": TOOL_PARSER,
                    # The checkpoint ships thinking-mode sampling as server defaults.
                    "generation_config": "vllm",
                    "after": ["nemotron"],
                    "weights_gib": 21.81,
                    "measured": {
                        "gpu_memory_utilization": 0.45,
                        "kv_cache_gib": 26.8,
                        "kv_pool_tokens": 858_483,
                        "cold_start_s": 335,
                    },
                },
                {
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
                    "after": ["nemotron", "q38"],
                    "weights_gib": 1.06,
                },
            ],
        }
    },
    __file__,
)
