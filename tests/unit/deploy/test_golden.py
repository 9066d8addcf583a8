"""Golden renders: each example's manifests as committed, so a change to the chart shows as a diff in review.

After an intended change, write them again and commit the diff with it:

    AGENTKV_UPDATE_GOLDEN=1 python3 -m pytest -p no:cacheprovider -q tests/unit/deploy/test_golden.py
"""

from __future__ import annotations

import difflib
import os

import pytest

from ._chart import EXAMPLE_NAMES, GOLDEN, stream, values

UPDATE = os.environ.get("AGENTKV_UPDATE_GOLDEN") == "1"


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_render_matches_golden(name: str) -> None:
    path = GOLDEN / f"{name}.yaml"
    rendered = stream(values(name))
    if UPDATE:
        path.write_text(rendered)
    assert path.exists(), f"no golden render for {name}: run the command in this module's docstring"
    golden = path.read_text()
    diff = "".join(
        difflib.unified_diff(
            golden.splitlines(True), rendered.splitlines(True), f"golden/{name}.yaml", "rendered"
        )
    )
    assert not diff, f"the chart renders differently from golden/{name}.yaml:\n{diff}"
