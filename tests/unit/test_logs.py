"""`sparkform logs`: which host and unit, the journalctl line it runs, and what it refuses before
connecting. Reading a real journal over SSH: tests/integration/test_converge.py."""

from __future__ import annotations

import shlex

import pytest
from samples import SERVED_PAIR

from sparkform import cli
from sparkform.commands.logs import engine_host, host_matches, journal_command


def test_the_journal_command_quotes_every_value():
    command = journal_command(["-u", "vllm-q38.service"], "1 hour ago", boot=True, follow=True)
    assert shlex.split(command) == [
        "journalctl", "-u", "vllm-q38.service", "--no-pager", "-o", "short-iso", "--since", "1 hour ago", "-b", "-f",
    ]  # fmt: skip
    assert journal_command(["-u", "vllm-a.service"], None, boot=False, follow=False).endswith("-o short-iso")


def test_the_engine_is_found_on_its_host_or_named_as_missing(make_host, seed_data):
    spark = make_host(seed_data, name="spark")
    other = make_host(seed_data, name="spark-2")
    assert engine_host([spark], "q38", None) is spark
    assert engine_host([spark, other], "q38", "spark-2") is other
    with pytest.raises(ValueError, match=r"engine q38 runs on spark, spark-2: choose one with --host"):
        engine_host([spark, other], "q38", None)
    with pytest.raises(ValueError, match=r"the inventory has no engine 'q83' \(engines: nemotron, q38\)"):
        engine_host([spark], "q83", None)
    with pytest.raises(ValueError, match=r"host spark-3 has no engine 'q38' \(engines: none\)"):
        engine_host([spark], "q38", "spark-3")


@pytest.mark.parametrize("since", ["$(id)", "1h; reboot", "a" * 41])
def test_a_since_journalctl_would_not_read_is_refused_before_connecting(since, capsys):
    assert cli.main(["logs", str(SERVED_PAIR), "q38", "--since", since]) == 2
    assert capsys.readouterr().err.startswith(f"sparkform logs: --since {since!r} is not a time journalctl reads")


def test_an_engine_the_inventory_lacks_is_named_before_connecting(capsys):
    assert cli.main(["logs", str(SERVED_PAIR), "q83"]) == 2
    assert capsys.readouterr().err == "sparkform logs: the inventory has no engine 'q83' (engines: nemotron, q38)\n"


def test_without_an_engine_every_journal_of_the_host_is_merged(make_host, seed_data):
    """One journalctl over every unit of sparkform's (their lines and systemd's about them) and
    the lines its programs write from units of their own: any of them, in time order."""
    words = shlex.split(journal_command(host_matches(make_host(seed_data, name="spark")), None, False, False))
    matches = words[1 : words.index("--no-pager")]
    assert matches[1::2] == ["+"] * (len(matches) // 2)  # any of them
    assert matches[::2] == [
        "_SYSTEMD_UNIT=vllm-nemotron.service", "UNIT=vllm-nemotron.service",
        "_SYSTEMD_UNIT=vllm-q38.service", "UNIT=vllm-q38.service",
        "_SYSTEMD_UNIT=sparkform-guard.service", "UNIT=sparkform-guard.service",
        "_SYSTEMD_UNIT=sparkform-recover@nemotron.service", "UNIT=sparkform-recover@nemotron.service",
        "_SYSTEMD_UNIT=sparkform-recover@q38.service", "UNIT=sparkform-recover@q38.service",
        "_SYSTEMD_UNIT=sparkform-scrub.service", "UNIT=sparkform-scrub.service",
        "_SYSTEMD_UNIT=nginx.service", "UNIT=nginx.service",
        "SYSLOG_IDENTIFIER=sparkform-guard", "SYSLOG_IDENTIFIER=sparkform-scrub",
        "SYSLOG_IDENTIFIER=sparkform-rollback",
    ]  # fmt: skip


def test_a_host_that_does_not_answer_is_said_in_one_line_of_sparkforms(tmp_path, capsys):
    """ssh's 255 (no connection) is not passed on as the command's code."""
    inventory = tmp_path / "unreachable.py"
    inventory.write_text(
        "import runpy\nfrom sparkform.rules.inventory import hosts\n"
        f"name, data = runpy.run_path({str(SERVED_PAIR)!r})['spark'][0]\n"
        "data.update(ssh_hostname='127.0.0.1', ssh_port=9)  # nothing listens there\n"
        "spark = hosts({name: data}, __file__)\n"
    )
    code = cli.main(["logs", str(inventory), "q38"])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("sparkform logs: spark.local does not answer over SSH ("), err
