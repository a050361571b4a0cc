"""The object `sparkform status --json` prints per host (docs/status.md is its JSON schema):
what sparkform/reports/status.py reads from a host, and sparkform/reports/status_table.py shows."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from sparkform.readers.gpu import NvmlReport

SCHEMA_VERSION: Literal[1] = 1


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class WatchdogEvent(Model):
    at: float
    """unix time the guard journaled it"""
    event: str
    """failed, retry-scheduled, retry, hung, recovered, memory-low, memory-critical, memory-recovered, ..."""
    engine: str
    """the engine it concerns, "-" for the host"""
    message: str


class ServiceStatus(Model):
    unit: str
    active_state: str
    sub_state: str


class EngineStatus(Model):
    name: str
    unit: str
    enabled: bool
    """enabled in the inventory (a disabled engine never counts against the exit code)"""
    serving: bool
    """the unit is active and /health answers 200 (a headless rank: the unit is active, its process running)"""
    rank: int = 0
    """this host's rank in an engine across hosts (engines[].nodes): 0 for the head or an engine of one host; a rank >
    0 runs headless, so its API, /health and metrics are the head's"""
    active_state: str
    sub_state: str
    since: float | None
    """unix time the unit entered its current state"""
    restarts: int
    """systemd's automatic restarts of the unit this boot (its "Scheduled restart job" journal entries)"""
    main_pid: int
    """0 when no process runs"""
    memory_bytes: int | None
    """the unit's cgroup memory now"""
    memory_high_bytes: int | None
    """MemoryHigh (None: no limit)"""
    memory_max_bytes: int | None
    """MemoryMax (None: no limit)"""
    port: int
    """the port clients use (the front's when there is one)"""
    health_http: int | None
    """the HTTP status of the engine's own /health (None: no answer)"""
    front_http: int | None = None
    """the HTTP status of /v1/models through the front, with the key (None: no answer)"""
    launch: str | None = None
    """what its launch said while it started: "waiting OTHER" (its turn behind a loading neighbour), "loading"; None
    once it serves"""
    kind: str = "generate"
    """what it serves (engines[].kind): generate, or a pooling engine: embed, score, rerank"""
    vllm_version: str | None = None
    """the vLLM installed in the venv it runs from (engines[].vllm_version, else the host's; None: no venv yet)"""
    served_names: list[str]
    """the model names the engine answers to (the inventory's; vLLM's /metrics names only the first)"""
    kv_pool_tokens: int | None
    """the KV cache pool in tokens (vllm:cache_config_info)"""
    kv_use: float | None
    """the share of the KV pool in use, 0..1"""
    requests_running: int | None
    requests_waiting: int | None
    generation_tokens_per_s: float | None
    """generated tokens per second over the sampling interval (None: no sample, or the engine restarted meanwhile)"""
    last_start_at: float | None
    """unix time its main process last started"""
    last_start_s: float | None
    """seconds that start took to readiness (None while not ready since)"""
    recorded_cold_start_s: float | None
    """the last cold start the host record measured, else the inventory's measured.cold_start_s"""


class HostStatus(Model):
    schema_version: Literal[1] = SCHEMA_VERSION
    host: str
    reachable: bool
    error: str | None = None
    """why the host could not be read (unreachable: ssh's last line)"""
    checked_at: float
    """unix time on this machine when the host answered"""
    serving: bool
    """every enabled engine serves, through the front too: `sparkform status` exits 0 only when this holds on every
    host and `problems` is empty"""
    problems: list[str] = Field(default_factory=list)
    """what keeps clients from being served or the box from being watched or restarted, one line each (an engine
    that does not serve, the front not passing a keyed request, the guard not running, an engine whose venv does
    not run)"""
    services: list[ServiceStatus] = Field(default_factory=list)
    """the guard, the front and the scrub timer"""
    mem_total_bytes: int | None = None
    mem_available_bytes: int | None = None
    unified_in_use_bytes: int | None = None
    """MemTotal - MemAvailable: on GB10's unified memory, what the CPU and the GPU use together"""
    gpu: NvmlReport | None = None
    """NVML's report read on the host with pynvml by the engine venv's Python (None: not read)"""
    vllm_version: str | None = None
    """the vLLM the host's own venv holds (its engines' unless they name their own: each engine's `vllm_version`)"""
    front_tls: str | None = None
    """the SHA-256 fingerprint of the certificate the front serves over TLS (None: plain HTTP, or none read)"""
    drift: list[str] = Field(default_factory=list)
    """how the host changed since its record, one line each (the deploy prints the same lines)"""
    watchdog: list[WatchdogEvent] = Field(default_factory=list)
    """the guard's alerts this boot, the latest last"""
    engines: list[EngineStatus] = Field(default_factory=list)
    untrusted: list[str] = Field(default_factory=list)
    """values read back in a shape sparkform never writes: left out"""
