"""The request contract of the vLLM version each engine serves (sparkform/reports/contract.py), asked as
`sparkform contract` asks it: curl on the host, the OpenAI routes through the front with the key."""

from __future__ import annotations

from sparkform.commands import ssh
from sparkform.commands.contract import REQUEST_TIMEOUT_S, live_version, ssh_asker
from sparkform.reports.contract_requests import check_engine


def test_engine_keeps_the_request_contract_of_its_vllm(target, engine, ssh_folder):
    ssh_config = ssh.write_config(target.name, target.ssh_data, ssh_folder)
    ask = ssh_asker(ssh_config, target.name, target.config, engine, REQUEST_TIMEOUT_S)
    findings = check_engine(ask, target.config, engine, live_version(ask))
    for finding in findings:
        print(f"{engine.name}: {finding.check}: {finding.result}: {finding.detail}")
    failed = [f"{finding.check}: {finding.detail}" for finding in findings if finding.result == "fail"]
    assert not failed, "\n".join(failed)
