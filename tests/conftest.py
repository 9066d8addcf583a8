"""Suite-wide: figures a test wants in the run's output (pytest hides a passing test's prints)."""

from __future__ import annotations

from typing import Any

import pytest

REPORT_KEY = pytest.StashKey[list[str]]()


@pytest.fixture
def report(pytestconfig: pytest.Config) -> Any:
    """``report("...")`` adds a line to the terminal summary of this run."""
    lines = pytestconfig.stash.setdefault(REPORT_KEY, [])
    return lines.append


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    del exitstatus
    lines = config.stash.get(REPORT_KEY, [])
    if lines:
        terminalreporter.section("agentkv figures")
        for line in lines:
            terminalreporter.write_line(line)
