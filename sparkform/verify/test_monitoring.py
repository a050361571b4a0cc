"""With `monitoring` on (skipped otherwise): node_exporter runs with sparkform's settings and
serves, on the host, both engines' units and sparkform's textfile metrics."""

from __future__ import annotations

import re

import pytest

from sparkform.domain import layout
from sparkform.writers.render import bracketed


def test_node_exporter_serves_the_engine_units_and_sparkforms_metrics(remote, config):
    if not config.monitoring.enabled:
        pytest.skip("monitoring is off in the inventory")
    service = remote.service(layout.NODE_EXPORTER_UNIT)
    assert service.is_enabled and service.is_running
    for path in config.monitoring.textfiles:
        textfile = remote.file(path)
        assert textfile.exists and textfile.user == "root" and textfile.mode == 0o644, path
    address = "127.0.0.1" if config.monitoring.listen_address in ("0.0.0.0", "::") else config.monitoring.listen_address
    text = remote.check_output(f"curl -fsS --max-time 10 http://{bracketed(address)}:{config.monitoring.port}/metrics")
    for engine in config.enabled_engines:
        assert re.search(rf'^node_systemd_unit_state\{{name="{re.escape(engine.unit)}",state="active"', text, re.M)
    assert re.search(r"^sparkform_host_info\{", text, re.M) and re.search(r"^node_textfile_scrape_error 0$", text, re.M)
