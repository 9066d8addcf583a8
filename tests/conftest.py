"""Suite-wide: the property tests' profile, and lines a test wants in the run's output (pytest hides a passing
test's prints).

Property tests run the `ci` profile unless `HYPOTHESIS_PROFILE` names another: derandomized (the examples
follow from the test's code, not from a random seed), no example database (a failure found once on one
machine is not replayed there alone), a bounded count and no per-example deadline (a slow machine is not a
failure). So a run's verdict depends on the code, not on the draw. To search much further, by hand:

    HYPOTHESIS_PROFILE=thorough python3 -m pytest -p no:cacheprovider tests/unit
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    max_examples=100,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
# Random draws, many more of them, and the local example database, so a failure found is replayed next time.
settings.register_profile("thorough", max_examples=5000, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

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
