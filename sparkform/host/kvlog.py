"""What vLLM prints about its KV pool, read back on the host for the KV ledger (sparkform-guard
served) and by sparkform's parsers on the laptop: one set of patterns and bounds for both.

The journal lines are the engine's own writing: only what the patterns take is read, from at
most JOURNAL_BYTES, and every number is bounded.
"""

import os
import re

# Match the message text anywhere in the line: the prefix differs between vLLM versions
# (`(EngineCore pid=N) INFO MM-DD HH:MM:SS [file.py:N] `) and journald output modes.
# The device word is GPU, CPU or XPU (<= 0.29 always GPU); 0.33 may add ` + host` after it.
KV_SIZE = re.compile(r"\b(?P<device>[A-Z]{3})(?:\s*\+\s*[A-Za-z]+)*\s+KV cache size:\s*(?P<tokens>\d[\d,]*)\s+tokens")
KV_CONCURRENCY = re.compile(
    r"Maximum concurrency for (?P<max_model_len>\d[\d,]*) tokens per request:\s*(?P<concurrency>\d[\d,]*(?:\.\d+)?)x"
)
KV_AVAILABLE = re.compile(r"Available KV cache memory:\s*(?P<gib>\d+(?:\.\d+)?) GiB")
# Printed once per start (with the version, KV_VERSION): lets a new boot drop a stale
# "Available" figure left by a boot that died before it logged its pool.
KV_BOOT_MARKER = "vLLM API server version"
# The version a start runs: the API server's line (<= 0.29), or the EngineCore's "Initializing a V1
# LLM engine (v0.32.0) with config" (0.32 prints its version only there and in an ASCII banner).
KV_VERSION = re.compile(
    r"(?:" + KV_BOOT_MARKER + r" |Initializing a V1 LLM engine \(v)(?P<version>[0-9]+\.[0-9]+[0-9A-Za-z.+-]{0,40})"
)
# What a ledger row may name (sparkform/reports/ledger.py: `sparkform ledger` checks the rows against
# them): a checkpoint folder's name (owner--name@commit) and a KV dtype.
CHECKPOINT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}@[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
KV_DTYPE = re.compile(r"[a-z0-9_]{1,32}")
# The engine's flags the pool depends on, as the deploy writes them into its args file
# (sparkform.writers.render.engine_args writes them by these names).
SETTING_FLAGS = {
    "checkpoint": "--model",
    "max_model_len": "--max-model-len",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "kv_cache_memory_bytes": "--kv-cache-memory-bytes",
    "kv_cache_dtype": "--kv-cache-dtype",
}
JOURNAL_BYTES = 16 * 2**20  # one start's journal; vLLM prints its pool within the first few hundred lines
LINE_CHARS = 4096  # a ledger line longer than this is none sparkform-guard wrote (its rows are ~600)
MAX_TOKENS = 10**12
MAX_GIB = 100000.0
INVOCATION_ID = re.compile(r"[0-9a-f]{32}")


def bounded(text, kind, limit):
    value = kind(text.replace(",", ""))
    if not 0 <= value <= limit:
        raise ValueError(f"{text} is out of bounds")
    return value


def printed_pool(lines):
    """(the version, the pool) this start printed: the pool's line, the concurrency line after it
    and the "Available KV cache memory" line before it; the pool is None when no line names one."""
    version, available, pool = None, None, None
    for line in lines:
        if version is None and (match := KV_VERSION.search(line)):
            version = match["version"]
        if match := KV_AVAILABLE.search(line):
            available = bounded(match["gib"], float, MAX_GIB)
        if match := KV_SIZE.search(line):
            pool = {
                "device": match["device"],
                "tokens": bounded(match["tokens"], int, MAX_TOKENS),
                "window": None,
                "concurrency": None,
                "kv_gib": available,
            }
        if pool and pool["concurrency"] is None and (match := KV_CONCURRENCY.search(line)):
            pool["window"] = bounded(match["max_model_len"], int, MAX_TOKENS)
            pool["concurrency"] = bounded(match["concurrency"], float, MAX_TOKENS)
    return version, pool


def started_settings(args_path):
    """The settings a pool depends on, from the args file the engine started with (root's, one
    argument a line; the last of a repeated flag wins, as in vLLM's argparse)."""
    with open(args_path) as handle:
        args = handle.read(2**20).splitlines()

    def last(setting):
        found = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == SETTING_FLAGS[setting]]
        return found[-1] if found else None

    utilization, kv_bytes = last("gpu_memory_utilization"), last("kv_cache_memory_bytes")
    checkpoint = os.path.basename(last("checkpoint") or "")
    dtype = last("kv_cache_dtype") or "auto"
    if not CHECKPOINT.fullmatch(checkpoint) or not KV_DTYPE.fullmatch(dtype):
        raise ValueError(f"{args_path} names no checkpoint folder or KV dtype sparkform writes")
    return {
        "checkpoint": checkpoint,
        "max_model_len": bounded(last("max_model_len") or "", int, MAX_TOKENS),
        "gpu_memory_utilization": None if kv_bytes or utilization is None else bounded(utilization, float, 1.0),
        "kv_cache_memory_bytes": None if kv_bytes is None else bounded(kv_bytes, int, int(MAX_GIB * 2**30)),
        "kv_cache_dtype": dtype,
    }
