"""Suite-wide: lines a test wants in the run's output (pytest hides a passing test's prints)."""

from __future__ import annotations

from typing import Any

import pytest

PLUGIN = "agentkv-summary"


class Summary:
    """Terminal-summary sections by title, printed in the order they were first written to.

    Registered as a plugin so that other conftests reach it by name (conftests should not import each other):
    ``config.pluginmanager.get_plugin(PLUGIN).section(title)``."""

    def __init__(self) -> None:
        self.sections: dict[str, list[str]] = {}

    def section(self, title: str) -> list[str]:
        return self.sections.setdefault(title, [])

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        for title, lines in self.sections.items():
            if lines:
                terminalreporter.section(title)
                for line in lines:
                    terminalreporter.write_line(line)


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(Summary(), PLUGIN)


@pytest.fixture
def report(pytestconfig: pytest.Config) -> Any:
    """``report("...")`` adds a line to the "agentkv figures" summary of this run."""
    return pytestconfig.pluginmanager.get_plugin(PLUGIN).section("agentkv figures").append
