"""The KV pool ledger: sparkform-guard's `served` run for real as a process (a journalctl stand-in
prints a captured vLLM log for this start's invocation) appends the pool vLLM printed, checked
here against sparkform's own parser; rows read back are checked field by field; `sparkform
ledger`'s table; `sparkform plan --ledger` plans with the newest matching row. The live side
(the sandbox's real journal, a restart by systemd): tests/integration/test_watchful.py."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from samples import SERVED_PAIR
from script_box import cpu_host_under, put
from standins import recording_command

from sparkform import cli
from sparkform.domain.layout import KV_LEDGER_ROWS
from sparkform.readers.parsers import parse_kv_pool, parse_vllm_version
from sparkform.reports import ledger
from sparkform.rules.inventory import load_host, load_inventory
from sparkform.sandbox import models
from sparkform.writers.render import render_host

REPO = Path(__file__).resolve().parents[2]
CAPTURED = REPO / "tests" / "fixtures" / "captured"
INVOCATION = "0123456789abcdef0123456789abcdef"
MIB = 2**20


class HostGuard:
    """The rendered guard, guard.json and args files of a one-engine CPU host under `root`, with
    journalctl and systemctl stand-ins; `log` is what journalctl prints for this start."""

    def __init__(self, root: Path, **engine):
        self.root = root
        host = load_host(
            "ledger-test",
            {
                **cpu_host_under(root),
                "engines": [
                    {
                        "name": "q38",
                        "port": 8011,
                        "kv_cache_memory_bytes": 256 * MIB,
                        "max_model_len": 2048,
                        "max_num_seqs": 4,
                        "model_config_path": "model_configs/tiny-llama.json",
                        "checkpoint": {"repo": "sparkform-test/tiny-llama", "revision": "c" * 40},
                        **engine,
                    }
                ],
            },
            REPO / "inventory",
        )
        self.config = host.config
        put(render_host(host.config, host.model_configs), root)
        self.settings = Path(host.config.paths.guard_config)
        self.guard_config = json.loads(self.settings.read_text())
        Path(self.guard_config["state_dir"]).mkdir(parents=True)
        self.script = Path(host.config.paths.guard)
        self.args_file = Path(host.config.paths.engine_settings("q38")[1])
        self.ledger = Path(host.config.paths.kv_ledger)
        self.log = root / "start.log"
        self.calls = root / "calls"
        bin_dir = root / "bin"
        recording_command(bin_dir, "journalctl", self.calls, f"cat {shlex.quote(str(self.log))}")
        recording_command(bin_dir, "systemctl", self.calls)
        self.env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "INVOCATION_ID": INVOCATION}

    def served(self, log: list[str], **env: str) -> subprocess.CompletedProcess:
        self.log.write_text("\n".join(log) + "\n")
        return subprocess.run(
            [sys.executable, str(self.script), "served", "q38"],
            env=self.env | env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def rows(self) -> list[dict]:
        return [json.loads(line) for line in self.ledger.read_text().splitlines()] if self.ledger.exists() else []


def cpu_start(tokens: str = "262,144", concurrency: str = "128.00") -> list[str]:
    """vLLM 0.32's CPU start (tests/fixtures/captured/vllm-0.32-cpu.log) with this pool."""
    lines = (CAPTURED / "vllm-0.32-cpu.log").read_text().splitlines()
    pool = {"1,048,576 tokens": f"{tokens} tokens", "512.00x": f"{concurrency}x"}
    return [_replaced(line, pool) for line in lines]


def _replaced(line: str, replacements: dict[str, str]) -> str:
    for old, new in replacements.items():
        line = line.replace(old, new)
    return line


@pytest.fixture
def guard(tmp_path) -> HostGuard:
    return HostGuard(tmp_path)


def test_a_served_start_appends_what_vllm_printed_beside_the_prediction(guard):
    log = cpu_start()
    result = guard.served(log)
    assert result.returncode == 0, result.stderr
    (row,) = guard.rows()
    pool = parse_kv_pool(log)  # sparkform's own parser, independent of the host's script
    assert row["measured"] == {
        "device": pool.device,
        "tokens": pool.tokens,
        "window": pool.max_model_len,
        "concurrency": pool.concurrency,
        "kv_gib": pool.available_gib,
    }
    assert row["vllm"] == parse_vllm_version(log) == "0.32.0"
    assert row["engine"] == "q38" and row["checkpoint"] == f"sparkform-test--tiny-llama@{'c' * 40}"
    assert (row["max_model_len"], row["kv_cache_memory_bytes"], row["kv_cache_dtype"]) == (2048, 256 * MIB, "auto")
    assert row["gpu_memory_utilization"] is None  # the pool is pinned in bytes: no utilization passed
    # tiny-llama: 2 layers x 2 KV heads x (K+V) x 32 x float32 = 1 KiB a token, 256 MiB of pool.
    assert row["predicted"] == {
        "kv_gib": 0.25,
        "tokens": 262_144,
        "concurrency": 128.0,
        "source": "KV from kv_cache_memory_bytes; tokens/GiB from config.json",
    }
    assert f"journalctl --no-pager -o cat _SYSTEMD_UNIT=vllm-q38.service _SYSTEMD_INVOCATION_ID={INVOCATION}" in (
        guard.calls.read_text()
    )
    assert guard.ledger.stat().st_mode & 0o777 == 0o644
    (checked,) = ledger.read_rows(guard.ledger.read_text().splitlines(), "ledger", untrusted := [])
    assert untrusted == [] and checked.measured.tokens == 262_144


def test_gpu_lines_carry_the_available_memory_of_the_same_start(guard):
    log = (CAPTURED / "vllm-0.29-one-line.log").read_text().splitlines()
    guard.served(log)
    (row,) = guard.rows()
    pool = parse_kv_pool(log)
    assert (row["measured"]["kv_gib"], row["measured"]["tokens"]) == (pool.available_gib, pool.tokens)
    assert row["measured"]["kv_gib"] is not None


def test_each_start_is_one_more_row_and_only_the_last_are_kept(guard):
    guard.guard_config["kv_ledger_rows"] = 3
    guard.settings.write_text(json.dumps(guard.guard_config))
    for tokens in ("1,000", "2,000", "3,000", "4,000"):
        guard.served(cpu_start(tokens=tokens))
    assert [row["measured"]["tokens"] for row in guard.rows()] == [2000, 3000, 4000]


def test_settings_other_than_the_deploys_get_no_prediction(guard):
    # A rollback put back kept settings: the args file says another window than guard.json's.
    guard.args_file.write_text(guard.args_file.read_text().replace("\n2048\n", "\n1024\n"))
    guard.served(cpu_start())
    (row,) = guard.rows()
    assert row["max_model_len"] == 1024 and row["predicted"] is None


@pytest.mark.parametrize(
    ("log", "env", "why"),
    [
        (["INFO vLLM API server version 0.32.0", "nothing about a pool"], {}, "printed no KV cache size"),
        (cpu_start(tokens="9" * 40), {}, "out of bounds"),
        (cpu_start(), {"INVOCATION_ID": "$(reboot)"}, "no INVOCATION_ID"),
    ],
    ids=["no-pool-line", "absurd-tokens", "no-invocation"],
)
def test_a_start_without_a_trustworthy_pool_adds_no_row_and_still_succeeds(guard, log, env, why):
    result = guard.served(log, **env)
    assert result.returncode == 0
    assert why in result.stderr  # journaled (stderr here: no journal socket)
    assert guard.rows() == []
    assert "systemctl reset-failed vllm-q38.service" in guard.calls.read_text()  # its real job still done


# --- reading it back ---------------------------------------------------------------------------------

GOOD_ROW = {
    "time": "2026-12-01T09:31:02Z",
    "engine": "nemotron",
    "vllm": "0.32.0",
    "checkpoint": f"sparkform-test--tiny-qwen3@{'a' * 40}",
    "max_model_len": 2048,
    "gpu_memory_utilization": None,
    "kv_cache_memory_bytes": 256 * MIB,
    "kv_cache_dtype": "auto",
    "measured": {"device": "CPU", "tokens": 131_072, "window": 2048, "concurrency": 64.0, "kv_gib": None},
    "predicted": {"kv_gib": 0.25, "tokens": 131_072, "concurrency": 64.0, "source": "KV from x; tokens/GiB from y"},
}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"engine": "../etc"}, "engine"),
        ({"time": "yesterday"}, "time"),
        ({"vllm": "0.32; rm -rf /"}, "vllm"),
        ({"checkpoint": "../../secrets@x"}, "checkpoint"),
        ({"max_model_len": "2048"}, "max_model_len"),  # a string where a number belongs
        ({"measured": {**GOOD_ROW["measured"], "tokens": 10**13}}, "measured.tokens"),
        ({"measured": {**GOOD_ROW["measured"], "device": "gpu\n"}}, "measured.device"),
        ({"predicted": {**GOOD_ROW["predicted"], "source": "<script>"}}, "predicted.source"),
        ({"extra": 1}, "extra"),
    ],
)
def test_a_row_of_another_shape_is_left_out_and_named(change, field):
    untrusted: list[str] = []
    lines = [json.dumps(GOOD_ROW), json.dumps(GOOD_ROW | change)]
    rows = ledger.read_rows(lines, "/var/lib/sparkform/record/kv-ledger.jsonl", untrusted)
    assert len(rows) == 1
    (why,) = untrusted
    assert why.startswith("/var/lib/sparkform/record/kv-ledger.jsonl line 2 left out: " + field)


def test_a_link_and_an_overlong_line_are_left_out():
    untrusted: list[str] = []
    lines = ["@@link:/var/lib/sparkform/record/kv-ledger.jsonl", json.dumps(GOOD_ROW) + " " * ledger.LINE_CHARS]
    assert ledger.read_rows(lines, "ledger", untrusted) == []
    assert "is a symbolic link" in untrusted[0] and "longer than any row" in untrusted[1]


def test_the_table_puts_prediction_beside_measurement_with_the_error():
    raised = GOOD_ROW | {
        "engine": "q38",
        "gpu_memory_utilization": 0.45,
        "kv_cache_memory_bytes": None,
        "max_model_len": 262_144,
        "measured": {"device": "GPU", "tokens": 858_483, "window": 262_144, "concurrency": 3.27, "kv_gib": 26.8},
        "predicted": {"kv_gib": 27.0, "tokens": 900_000, "concurrency": 3.43, "source": "KV from a; tokens/GiB from b"},
    }
    rows = ledger.read_rows([json.dumps(GOOD_ROW), json.dumps(raised)], "ledger", [])
    table = ledger.format_ledger("spark", rows, ["x line 3 left out: engine: bad"]).splitlines()
    assert table[0].startswith("host spark: KV pool ledger, 2 start(s)")
    header, cpu, gpu = table[1].split(), table[2].split(), table[3].split()
    assert header[:2] == ["date", "(UTC)"]
    assert cpu[:5] == ["2026-12-01", "09:31", "nemotron", "0.32.0", "-"]
    assert "131,072" in cpu and "+0.0" in cpu
    # 900,000 against 858,483: +4.8 %; 27.0 against 26.8 GiB: +0.7 %; 3.43x against 3.27x: +4.9 %.
    assert gpu[gpu.index("858,483") + 1 : gpu.index("858,483") + 4] == ["900,000", "+4.8", "%"]
    assert gpu[gpu.index("26.80") + 1 : gpu.index("26.80") + 4] == ["27.00", "+0.7", "%"]
    assert gpu[gpu.index("3.27x") + 3 : gpu.index("3.27x") + 6] == ["3.43x", "+4.9", "%"]
    assert "  left out (untrusted): x line 3 left out: engine: bad" in table


# --- planning with it --------------------------------------------------------------------------------


def ledger_file(tmp_path: Path, host: str, rows: list[dict]) -> Path:
    path = tmp_path / "ledger.jsonl"
    path.write_text(json.dumps({"host": host, "rows": rows, "untrusted": [], "error": None}) + "\n")
    return path


def test_plan_takes_the_newest_matching_row_for_an_engine_without_measured(tmp_path, capsys):
    inventory = REPO / "inventory" / "sandbox.py"
    (host,) = [h.name for h in load_inventory(inventory)]
    older = GOOD_ROW | {"time": "2026-12-01T08:00:00Z", "measured": {**GOOD_ROW["measured"], "tokens": 100_000}}
    newer = GOOD_ROW | {"measured": {**GOOD_ROW["measured"], "tokens": 120_000}}
    other_window = GOOD_ROW | {"time": "2026-12-01T10:00:00Z", "max_model_len": 4096}
    other_vllm = GOOD_ROW | {"time": "2026-12-01T10:00:00Z", "vllm": "0.33.0"}
    path = ledger_file(tmp_path, host, [older, newer, other_window, other_vllm])
    assert cli.main(["plan", str(inventory), "--ledger", str(path), "--json"]) == 0
    (planned,) = json.loads(capsys.readouterr().out)
    nemotron = next(e for e in planned["engines"] if e["name"] == "nemotron")
    assert (nemotron["kv_source"], nemotron["tokens_source"]) == ("kv_cache_memory_bytes", "measured")
    assert nemotron["pool_tokens"] == 120_000  # the newest matching start, not the config.json's 131,072
    assert planned["ledger"] == [
        f"nemotron: measured figures from the ledger of {host}: the start of 2026-12-01 09:31 UTC "
        "(vLLM 0.32.0, window 2,048, 120,000 tokens)",
        "q38: no row of the ledger matches its settings (checkpoint repo, window, KV dtype, KV bytes, vLLM 0.32.0)",
        "embed: no row of the ledger matches its settings (checkpoint repo, window, KV dtype, KV bytes, vLLM 0.32.0)",
    ]
    q38 = next(e for e in planned["engines"] if e["name"] == "q38")
    assert q38["tokens_source"] == "config.json"


def test_plan_keeps_the_inventorys_measured_figures(tmp_path, capsys):
    inventory = SERVED_PAIR  # both engines carry measured figures
    hosts = load_inventory(inventory)
    engine = next(e for e in hosts[0].config.engines if e.measured.kv_pool_tokens)
    row = GOOD_ROW | {
        "engine": engine.name,
        "checkpoint": f"{engine.checkpoint.folder_prefix}{'a' * 40}",
        "max_model_len": engine.max_model_len,
        "kv_cache_memory_bytes": engine.kv_cache_memory_bytes,
        "kv_cache_dtype": engine.kv_cache_dtype,
        "vllm": hosts[0].config.vllm_version,
        "measured": {**GOOD_ROW["measured"], "kv_gib": 1.0, "tokens": 1},
    }
    assert cli.main(["plan", str(inventory), "--ledger", str(ledger_file(tmp_path, hosts[0].name, [row]))]) == 0
    out = capsys.readouterr().out
    assert "from the ledger" not in out


def test_plan_without_the_hosts_ledger_says_so_and_exits_1(tmp_path, capsys):
    inventory = REPO / "inventory" / "sandbox.py"
    assert cli.main(["plan", str(inventory), "--ledger", str(ledger_file(tmp_path, "elsewhere", []))]) == 1
    assert "not read (not in the file): planned with the inventory's figures" in capsys.readouterr().out


def test_a_ledger_file_of_another_shape_is_refused(tmp_path, capsys):
    path = tmp_path / "ledger.jsonl"
    path.write_text('["not", "a", "host"]\n')
    assert cli.main(["plan", str(REPO / "inventory" / "sandbox.py"), "--ledger", str(path)]) == 1
    assert "line 1 is not a host's ledger" in capsys.readouterr().err


def test_the_sandbox_inventory_plans_with_its_tiny_checkpoints_own_config():
    for repo, kind in models.TINY_MODELS.items():
        shipped = json.loads((REPO / "inventory" / "model_configs" / f"{repo.split('/')[1]}.json").read_text())
        assert shipped == models.model_config(models.SPECS[kind])


def test_the_kept_rows_bound_is_the_readers_too():
    untrusted: list[str] = []
    rows = ledger.read_rows([json.dumps(GOOD_ROW)] * (KV_LEDGER_ROWS + 5), "ledger", untrusted)
    assert len(rows) == KV_LEDGER_ROWS and untrusted == []
