"""The guard's judgements, called directly: a start's progress (StartJudge), the hang verdict on
a starved machine (HangJudge), the reason an unplanned stop is told with, and what it reads of
processes, cgroups and sockets (sparkform.host.procs) from files laid out as the kernel's, and
whether a head still waits for its ranks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from unix_engines import short_folder

from sparkform.host import procs
from sparkform.host.outages import why_stopped
from sparkform.host.ranks import joined_peers, waits_for_ranks
from sparkform.host.starts import STARVED_STALLS, STOPPED_S, StartJudge
from sparkform.host.watchdog import HangJudge


def verdicts(judge: StartJudge, samples: list[tuple[float, bool, str, float | None]]) -> list[str]:
    return [judge.judge(now, stopped, cursor, cpu) for now, stopped, cursor, cpu in samples]


def test_a_start_with_new_log_lines_or_cpu_work_is_never_stalled():
    judge = StartJudge(stall_s=60)
    # 10 minutes: a line every 50 s, or 30 % of a CPU between them (weights loading, a compile).
    samples = [(t, False, f"c{t // 50}", t * 0.3) for t in range(0, 600, 5)]
    assert set(verdicts(judge, samples)) == {"starts"}


def test_a_start_idle_under_the_cpu_share_and_silent_stalls_at_the_bound():
    judge = StartJudge(stall_s=60)
    # Idle polling: 5 % of a CPU, no new line. Stalled once 60 s passed since the last progress.
    samples = [(t, False, "c", t * 0.05) for t in range(0, 70, 5)]
    result = verdicts(judge, samples)
    assert result[:-2] == ["starts"] * (len(samples) - 2) and result[-2:] == ["stalled", "stalled"]
    assert judge.quiet_s(65) == 65


def test_unreadable_cpu_is_no_progress_and_a_new_line_is():
    judge = StartJudge(stall_s=30)
    assert verdicts(judge, [(0, False, "a", None), (20, False, "a", None), (25, False, "b", None)]) == ["starts"] * 3
    assert judge.judge(54, False, "b", None) == "starts" and judge.judge(55, False, "b", None) == "stalled"


def test_stopped_process_fails_the_start_after_stopped_s_despite_progress():
    judge = StartJudge(stall_s=600)
    samples = [(t, True, f"c{t}", t * 1.0) for t in range(0, STOPPED_S + 1, 5)]
    assert verdicts(judge, samples)[-1] == "stopped"
    # Stopped for a moment (a debugger attached, then detached): the count starts again.
    judge.forget()
    assert (
        verdicts(judge, [(0, True, "a", 0), (5, False, "b", 5), (10, True, "c", 10), (15, True, "d", 15)])
        == ["starts"] * 4
    )


def test_quiet_start_on_starved_host_waits_3_stall_bounds_unless_stopped():
    """CI: q38's start, silent and idle for 90 s on three sandboxes' two cores, was killed as stalled."""
    judge = StartJudge(stall_s=60)
    asked = []

    def starved_now() -> bool:
        asked.append(True)
        return True

    quiet = [judge.judge(t, False, "c", 0.0, starved_now) for t in range(0, 60 * STARVED_STALLS + 20, 10)]
    # Asked only of a start quiet past its bound, and within three; stalled once three passed.
    assert quiet[:6] == ["starts"] * 6 and len(asked) == quiet.count("starved") == 6 * STARVED_STALLS - 6
    assert set(quiet[6 : 6 * STARVED_STALLS]) == {"starved"} and quiet[6 * STARVED_STALLS :] == ["stalled"] * 2
    # Progress ends the starved spell: the bound counts from it again.
    assert judge.judge(200, False, "d", 0.0, starved_now) == "starts" and not judge.told_starved
    assert judge.judge(255, False, "d", 0.0, starved_now) == "starts"
    assert judge.judge(260, False, "d", 0.0, starved_now) == "starved"
    # The machine no longer starved: the old verdict at once.
    assert judge.judge(265, False, "d", 0.0, lambda: False) == "stalled"
    # A stopped process on a starved machine fails the start in STOPPED_S.
    judge.forget()
    stopped = [judge.judge(t, True, f"c{t}", float(t), starved_now) for t in range(0, STOPPED_S + 1, 5)]
    assert stopped[-1] == "stopped"


def never_progress() -> float:
    return 10.0


@pytest.mark.parametrize("counters", [never_progress, lambda: None])
def test_slow_probes_of_an_idle_engine_on_a_starved_machine_are_not_a_hang(counters):
    judge = HangJudge(3)
    rounds = [judge.judge(False, counters, starved=lambda: True) for _ in range(8)]
    assert rounds == ["waits", "waits", "starved", "starved", "starved", "starved", "starved", "starved"]
    # ...but starvation does not hold a verdict forever: the ninth failure in a row is a hang.
    assert judge.judge(False, counters, starved=lambda: True) == "hung"


def test_counters_first_read_during_a_starved_spell_find_a_busy_engine():
    """/metrics unanswered until the limit (a starved engine's API server): the spell's first
    reading is the baseline and the next one that moved calls the engine busy."""
    readings = iter([None, None, None, 40.0, 40.0, 55.0])
    judge = HangJudge(3)
    rounds = [judge.judge(False, lambda: next(readings), starved=lambda: True) for _ in range(6)]
    assert rounds == ["waits", "waits", "starved", "starved", "starved", "busy"]


def test_stopped_process_is_a_hang_at_the_limit_even_on_a_starved_machine():
    judge = HangJudge(3)
    rounds = [judge.judge(False, never_progress, starved=lambda: True, stopped=lambda: True) for _ in range(3)]
    assert rounds == ["waits", "waits", "hung"]


def test_a_machine_that_is_not_starved_keeps_the_old_verdict():
    judge = HangJudge(2)
    assert [judge.judge(False, never_progress, starved=lambda: False) for _ in range(2)] == ["waits", "hung"]


@pytest.mark.parametrize(
    ("result", "code", "status", "lines", "expected"),
    [
        ("success", "exited", "0", [], "exit code 0 (a fatal engine error can end in exit 0)"),
        ("signal", "killed", "KILL", [], "signal SIGKILL"),
        ("oom-kill", "killed", "KILL", [], "the kernel's OOM killer ended it"),
        (
            "exit-code",
            "exited",
            "4",
            [
                "sparkform-launch: /run/sparkform-engines/q38/api.sock already answers, so q38 cannot serve on it; see",
                "sparkform-wait-ready: engine main process 12 died after 0 s; its reason is in the unit's journal",
            ],
            "exit code 4; its last error line: sparkform-launch: /run/sparkform-engines/q38/api.sock already answers",
        ),
        (
            "exit-code",
            "exited",
            "1",
            ["INFO loading", "RuntimeError: CUDA error: out of memory\x1b[0m", "INFO shutting down"],
            "exit code 1; its last error line: RuntimeError: CUDA error: out of memory [0m",
        ),
    ],
)
def test_an_unplanned_stop_is_told_with_systemds_reason_and_last_error(result, code, status, lines, expected):
    assert why_stopped(result, code, status, lines).startswith(expected)


def test_the_quoted_error_line_is_bounded():
    assert len(why_stopped("exit-code", "exited", "1", ["Error: " + "x" * 5000])) < 300


def own_cgroup() -> str:
    """This process's cgroup (v2), as a unit's is named."""
    return next(line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::"))


def test_who_listens_on_a_socket_is_what_the_kernel_recorded_at_listen():
    """SO_PEERCRED: the pid and uid of the process that listens on the path; a process outside
    the unit's cgroup is a stranger, told by uid and command line; the unit's own, a socket
    bound but not listening and a path nobody holds are none."""
    with short_folder() as folder:
        engine_socket, bound_only = str(folder / "api.sock"), str(folder / "bound.sock")
        listening, bound = socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)
        with listening, bound:
            listening.bind(engine_socket)
            listening.listen()
            bound.bind(bound_only)
            assert procs.listener(engine_socket) == (os.getpid(), os.getuid())
            assert procs.listener(bound_only) is None and procs.listener(f"{folder}/none.sock") is None
            (held,) = procs.strangers(engine_socket, "/sparkform-test-no-such.service")
            assert held.startswith(f"uid {os.getuid()}: {os.getpid()} (")
            assert procs.strangers(engine_socket, own_cgroup()) == []
        assert procs.strangers(engine_socket, "/sparkform-test-no-such.service") == []  # closed


def test_a_stranger_process_is_named_by_its_command_line():
    with short_folder() as folder:
        engine_socket = str(folder / "api.sock")
        code = (
            f"import socket, time; s = socket.socket(socket.AF_UNIX); s.bind({engine_socket!r}); s.listen(); "
            "print(flush=True); time.sleep(60)"
        )
        squatter = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            squatter.stdout.readline()  # it listens
            (held,) = procs.strangers(engine_socket, "/sparkform-test-no-such.service")
            assert held.startswith(f"uid {os.getuid()}: {squatter.pid} ({sys.executable} -c import socket")
        finally:
            squatter.kill()
            squatter.wait()


def test_a_socket_name_with_a_newline_forges_no_listener():
    """Any local user may bind a socket in the abstract namespace (no folder's permission asked)
    under any name, a newline in it too, that reads as a listener at the engine's path in
    /proc/net/unix: the guard asks the socket itself, so that process is no stranger (else the
    guard would kill the engine at each start)."""
    with short_folder() as folder:
        engine_socket = str(folder / "api.sock")  # nobody listens there
        held, forging = socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)
        with held, forging:
            held.bind(f"\0{folder}-held".encode())
            held.listen()
            inode = os.fstat(held.fileno()).st_ino
            forging.bind(
                f"\0{folder}\n0000000000000000: 00000002 00000000 00010000 0001 01 {inode} {engine_socket}".encode()
            )
            assert procs.strangers(engine_socket, "/sparkform-test-no-such.service") == []


def test_a_process_state_and_uid_come_from_proc_and_a_stopped_one_is_found(tmp_path):
    for pid, stat, uid in ((10, "10 (a) b) S 1", 999), (11, "11 (vllm) T 1", 999), (12, "12 (x) t 1", 0)):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(stat)
        (tmp_path / str(pid) / "status").write_text(f"Name:\tx\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
    assert procs.process_state(10, str(tmp_path)) == "S"  # a ")" in the name does not fool it
    assert procs.stopped_pids([10, 11, 12, 13], str(tmp_path)) == [11, 12]
    assert procs.uid_of(11, str(tmp_path)) == 999 and procs.uid_of(13, str(tmp_path)) is None


def test_the_cgroup_v2_tree_is_found_where_mounted_and_its_cpu_time_read(tmp_path):
    hybrid = tmp_path / "mountinfo"
    hybrid.write_text(
        "50 111 0:50 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro\n"
        "52 50 0:30 / /sys/fs/cgroup/cpuacct ro - cgroup cgroup rw,cpuacct\n"
        "60 50 0:31 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
    )
    assert procs.cgroup2_root(str(hybrid)) == "/sys/fs/cgroup/unified"
    unit = tmp_path / "system.slice" / "vllm-q38.service"
    (unit / "sub").mkdir(parents=True)
    (unit / "cpu.stat").write_text("usage_usec 47937698\nuser_usec 1\n")
    (unit / "cgroup.procs").write_text("10\n11\n")
    (unit / "sub" / "cgroup.procs").write_text("12\n")
    assert procs.cpu_seconds("/system.slice/vllm-q38.service", str(tmp_path)) == pytest.approx(47.937698)
    assert sorted(procs.cgroup_pids("/system.slice/vllm-q38.service", str(tmp_path))) == [10, 11, 12]
    assert procs.cpu_seconds("/system.slice/gone.service", str(tmp_path)) is None


def test_a_head_counts_as_joined_only_other_hosts_on_its_master_port():
    """`ss -Htn state established` lines: the head's own processes (its node address, loopback,
    the address the connection came in on, an IPv4 address as a dual-stack socket shows it: CI,
    2026-12-03) are no rank; each other host counts once however many connections it holds."""
    text = (
        "0      0      10.234.1.1:29501 10.234.1.2:45678\n"
        "0      0      10.234.1.1:29501 10.234.1.2:45679\n"
        "0      0      10.234.1.1:29501 10.234.1.1:40000\n"
        "0      0      127.0.0.1:29501 127.0.0.1:39066\n"
        "0      9      [::ffff:10.234.1.1]:29501 [::ffff:10.234.1.1]:44690\n"
        "0      0      [::ffff:10.233.1.2]:29501 [::ffff:10.233.1.2]:44691\n"
        "0      0      [::ffff:10.234.1.1]:29501 [::FFFF:10.234.1.3]:44692\n"
        "0      0      [fe80::1]:29501 [fe80::2]:555\n"
        "0      0      10.234.1.1:29501 10.234.1.9:notaport\n"
        "a line of another shape\n"
    )
    assert joined_peers(text, "10.234.1.1") == {"10.234.1.2", "10.234.1.3", "[fe80::2]"}
    assert joined_peers("", "10.234.1.1") == set()


def test_a_head_joined_only_by_itself_still_waits_and_a_lone_engine_never():
    """Real store ports on loopback, one IPv4 and one dual-stack as vLLM's (`ss` shows its peers
    as [::ffff:127.0.0.1]): the head's own connection to either is no rank joined."""
    stores = [socket.create_server(("127.0.0.1", 0))]
    if socket.has_dualstack_ipv6():
        stores.append(socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True))
    sockets = list(stores)
    try:
        for store in stores:
            sockets.append(socket.create_connection(("127.0.0.1", store.getsockname()[1])))
            sockets.append(store.accept()[0])
            head = {"ranks": {"address": "127.0.0.1", "port": store.getsockname()[1], "count": 1}}
            assert waits_for_ranks(head), store.family
        assert not waits_for_ranks({"ranks": None})
    finally:
        for sock in sockets:
            sock.close()
