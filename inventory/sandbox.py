"""The sandbox: the Spark's whole box scaled down, on a local real-systemd host (`sparkform sandbox up`):
the pair, and the embedding engine the field notes order after both (bge-m3 on :8004 on a Spark).

Same deploy.py, same unit, launch script and readiness helper as on a Spark; what differs is
what cannot exist here: vLLM's CPU build (from an offline wheelhouse, hashed lock), tiny
checkpoints from a fake hub, and explicit KV pools (sparkform.sandbox.hostdata has the host's
data). SPARKFORM_SANDBOX picks the sandbox (default "sandbox"). The test suite converges the pair
alone (tests/integration/sandbox_pair.py: a third engine would cost a start in every module's
sandbox); one of its tests converges this whole box.
"""

import os
from pathlib import Path

from sparkform.inventory import hosts
from sparkform.sandbox.hostdata import CPU_ENGINE, host_data, host_name, up_box

NAME = os.environ.get("SPARKFORM_SANDBOX", "sandbox")
# Absolute: an inventory that edits this one (runpy) lives in another folder.
MODEL_CONFIGS = Path(__file__).resolve().parent / "model_configs"

box = up_box(NAME)  # None: `sparkform plan` works without it; pyinfra says it cannot connect

sandbox = hosts(
    {
        host_name(NAME, box): {
            **host_data(box),
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
                {
                    # The tiny Qwen3 checkpoint on vLLM's pooling runner, as Qwen3 embedding models are
                    # served: vectors of its hidden size, after both generators (ordering only).
                    **{field: value for field, value in CPU_ENGINE.items() if field != "tool_call_parser"},
                    "name": "embed",
                    "kind": "embed",
                    "port": 8004,
                    "checkpoint": {"repo": "sparkform-test/tiny-qwen3", "revision": "main"},
                    "after": ["nemotron", "q38"],
                },
            ],
        }
    },
    __file__,
)
