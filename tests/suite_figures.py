"""Figures that tests measure and CI's log should show (the exposure score of each hardened unit):
a test records one with `record_property("figure", "what: value")`; the controller, which gets
every xdist worker's reports, prints them all at the end of the run, in test order."""

from __future__ import annotations

import pytest


class SuiteFigures:
    def __init__(self) -> None:
        self.figures: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call":
            self.figures += [str(value) for name, value in report.user_properties if name == "figure"]

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.figures:
            terminalreporter.section("figures the tests measured")
            for figure in self.figures:
                terminalreporter.write_line(figure)
