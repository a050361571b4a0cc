"""Each script of bench/ run at its smallest size, so none rots unseen. The checkpoint bench runs
whole, as a process (the fake hub, curl and the scrub on this machine: about 3 s of CPU, 10 s of
wall time on 2 loaded cores). The others need a converged sandbox; here each gets what runs
without one, in 2 s or less: the front's program on the host against stand-in engines on
127.0.0.1, the counting hook of the no-op converge against this pyinfra, and the chaos run's and
the repeats' argument parsing, plans and references (their faults' alerts, their tests), and the
busy bench's reading of the guard's verdicts."""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from functools import cache
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from sparkform.host.alerts import ENGINE_EVENTS, HOST_EVENTS
from sparkform.rules.inventory import load_inventory

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
SCRIPTS = ("busy", "chaos", "checkpoint", "front", "noop_converge", "repeat")  # each has its test below


@cache
def bench(name: str) -> ModuleType:
    """bench/NAME.py as a module; the path to the live tests' helpers it adds is taken back."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    path = sys.path[:]
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path
    return module


def test_every_bench_script_is_a_python_file_this_module_runs():
    """A new script without its test here fails this. Costs nothing: a folder listed."""
    assert sorted(path.name for path in BENCH.iterdir()) == sorted(f"{name}.py" for name in SCRIPTS)
    for name in SCRIPTS:
        assert (BENCH / f"{name}.py").read_text().startswith("#!/usr/bin/env python3\n"), name


def test_the_checkpoint_bench_runs_whole_at_its_smallest_size():
    """One shard of 1 MiB, one round: every figure printed, the resumed shard verified. Costs
    about 3 s of CPU and 7-10 s of wall time here (the fake hub, curl, three fetches, two scrubs,
    the bench's own `sync`s; a busy disk lengthens those)."""
    result = subprocess.run(
        [sys.executable, str(BENCH / "checkpoint.py"), "--shards", "1", "--shard-mib", "1", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("first download, 1 MiB in 1 shards, median of 1 rounds"), lines
    assert "(10.0 % of the shard, target <= 15 %), verified" in result.stdout
    assert any(line.startswith("scrub of the 1 MiB fetched (--check-only)") for line in lines)
    assert lines[-1].startswith("no-op check of 22 GiB in 11 shards")


def test_front_bench_times_each_place_and_kind_against_stand_in_engines(servers, socket_dir):
    """The places and bodies of the sandbox inventory's nemotron, the program the host runs
    pointed at three stand-ins (2 rounds; the engine's own on a unix socket, as the engine
    serves), and the table it prints: the key goes to the front's ports only, never to the
    engine's own. Costs about 2 s: the inventory read, 12 requests, and the three stand-ins'
    shutdowns (0.5 s each, their poll interval)."""
    front = bench("front")
    (host,) = load_inventory(front.SANDBOX_INVENTORY)
    places, bodies = front.requests_to(host.config, "nemotron")
    assert places == {
        "engine": ["/run/sparkform-engines/nemotron/api.sock", "http://localhost/v1/chat/completions"],
        "own port": [None, "http://127.0.0.1:8012/v1/chat/completions"],
        "combined": [None, "http://127.0.0.1:8000/v1/chat/completions"],
    }
    assert bodies["streamed"]["stream"] and bodies["one token"]["max_tokens"] == 1
    engine_socket = socket_dir / "api.sock"
    stand_ins = {
        "engine": servers("engine", uds=engine_socket),
        "own port": servers("engine"),
        "combined": servers("engine"),
    }
    local = {
        "engine": [str(engine_socket), "http://localhost/v1/completions"],
        **{
            place: [None, f"http://127.0.0.1:{stand_ins[place].port}/v1/completions"]
            for place in ("own port", "combined")
        },
    }
    program = front.on_the_host(local, bodies, "bench-key", 2)
    out = subprocess.run([sys.executable, "-"], input=program, capture_output=True, text=True, timeout=60, check=True)
    times = json.loads(out.stdout)
    assert {place: {kind: len(pairs) for kind, pairs in kinds.items()} for place, kinds in times.items()} == {
        place: {"one token": 2, "streamed": 2} for place in places
    }
    for place, engine in stand_ins.items():
        keys = {request["headers"].get("Authorization") for request in engine.requests}
        assert keys == ({None} if place == "engine" else {"Bearer bench-key"}), place
        assert [json.loads(r["body"])["model"] for r in engine.requests] == ["nemotron"] * 4
    table = front.table(times)
    assert len(table) == 1 + 6 + 2 and table[-1].startswith("added at the median, streamed: the own port")


def test_the_no_op_converge_s_counting_hook_loads_against_this_pyinfra(tmp_path):
    """The hook patches SSHConnector's methods by name, then hands over to pyinfra's CLI; the
    counts are written at exit (a run that connects nowhere counts nothing). Costs about 1-2 s: one
    process that imports pyinfra. A converge needs the sandbox: no run here measures one."""
    noop = bench("noop_converge")
    counts = tmp_path / "counts.json"
    result = subprocess.run(
        [sys.executable, "-c", noop.COUNTING_PYINFRA, str(counts), "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and "pyinfra" in result.stdout, result.stdout + result.stderr
    assert json.loads(counts.read_text()) == {"commands": 0, "uploads": 0}
    assert (noop.ROOT / "deploy.py").is_file() and (noop.ROOT / "inventory" / "sandbox.py").is_file()


def test_the_chaos_run_s_arguments_and_plan():
    """The faults it lands and the alerts that must answer them need a converged sandbox; here its
    arguments and plan line, and what it matches against. Costs the module's import (0.1 s)."""
    chaos = bench("chaos")
    args, faults = chaos.parse_args(["--minutes", "0.5", "--seed", "7", "--faults", "kill-one,,front"])
    assert faults == ["kill-one", "front"]
    assert chaos.plan(args, faults, "sb") == "chaos: 0.5 min against sandbox sb, seed 7, faults kill-one, front"
    assert chaos.parse_args([])[1] == list(chaos.FAULTS)
    with pytest.raises(SystemExit) as refused:
        chaos.parse_args(["--faults", "kill-one,kill-all"])
    assert refused.value.code == 2
    # Each fault is matched by alerts the guard sends; each named set of faults is of the known ones.
    assert set(chaos.FAULT_ALERTS) == set(chaos.FAULTS)
    assert {event for events in chaos.FAULT_ALERTS.values() for event in events} <= {*ENGINE_EVENTS, *HOST_EVENTS}
    assert {*chaos.STALLS, *chaos.SERIAL_STARTS, *chaos.HELD_S} <= set(chaos.FAULTS)


def test_the_chaos_run_s_dark_times():
    """From one client's requests (start time, answered): how long a fault kept it dark. Costs
    nothing: no request is sent."""
    chaos = bench("chaos")
    client = chaos.Client(SimpleNamespace(address="127.0.0.1"), "q38", "key", until=0.0)
    client.results = [(0.0, True), (1.0, False), (2.0, False), (5.0, True), (6.0, False), (7.0, False)]
    assert client.longest_dark_s() == 4.0
    assert chaos.back_after(client, 0.5, 10.0) == 4.5  # failed from 1.0, answered again at 5.0
    assert chaos.back_after(client, 5.5, 10.0) is None  # never answered again
    assert chaos.back_after(client, 0.0, 1.0) == 0.0  # nothing failed before 1.0


def test_the_busy_bench_reads_the_guards_own_verdicts():
    """Its verdicts are the watchdog's own journal texts (a reworded one would leave every round
    with "no verdict"); read from journalctl's short-unix lines with their times."""
    busy = bench("busy")
    said = (ROOT / "sparkform" / "host" / "watchdog.py").read_text()
    assert all(text in said for text in busy.VERDICTS), busy.VERDICTS
    journal = (
        "1796685276.435401 dev sparkform-guard[2891]: sparkform-guard: vllm-q38.service answers no probe on a "
        "starved machine: waiting\n"
        "1796685306.500000 dev sparkform-guard[2891]: sparkform-guard: vllm-q38.service answered no probe for 3 "
        "rounds but its token counters moved: busy, not hung\n"
        "-- No entries --\n"
    )
    assert busy.parse_verdicts(journal) == [(1796685276.435401, "starved"), (1796685306.5, "busy")]


def test_each_repeat_runs_a_test_that_reads_its_rounds():
    """The repeated tests need a sandbox; here the command and the variable each repeat hands
    pytest, against the test's own source. Costs two files parsed (0.2 s)."""
    repeat = bench("repeat")
    for name, (variable, default, test) in repeat.REPEATS.items():
        command, variables = repeat.pytest_run(name, None)
        assert command[:2] == [sys.executable, "-m"] and command[-1] == test and variables == {variable: str(default)}
        assert repeat.pytest_run(name, 4)[1] == {variable: "4"}
        path, function = test.split("::")
        source = (ROOT / path).read_text()
        assert function in {node.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef)}
        assert f'os.environ.get("{variable}"' in source, (path, variable)


@pytest.mark.parametrize("argv", [["nope"], ["double-crash", "0"], ["pair-reboots", "100"], []])
def test_a_repeat_refuses_what_it_does_not_know(argv):
    """Exit 2 and the usage, before any sandbox. Costs a Python start (0.15 s) each."""
    result = subprocess.run([sys.executable, str(BENCH / "repeat.py"), *argv], capture_output=True, text=True)
    assert result.returncode == 2 and "usage: repeat.py" in result.stderr, result.stderr
