"""Issue 4: every example in examples/ runs to the end against the real router (the tiny model) and prints
its per-turn router line and the per-call stats table.

Each example runs as a user would start it (its own process, the flags of examples/_common.py), with
``--force-tools 1``: the random-weight tiny model calls a tool only when ``tool_choice="required"`` forces it
(one call per step, bounded arguments, see agentkv/server/launch/_model.py), then answers under ``"none"``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ._helpers import MODEL, RouterProc

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))
EXTRAS = {"langchain_agent": "langchain_openai", "llamaindex_agent": "llama_index.llms.openai_like"}
TURNS = 2
TIMEOUT_S = 240
# x-agentkv-reuse values (agentkv/_constants.py); "unknown" would mean the router's headers never arrived.
VERDICTS = {"hit", "miss", "expired", "declined", "mismatch", "none", "local"}


def stats_rows(stdout: str) -> list[list[str]]:
    """The body rows of the per-call table that render_summary prints (``│ 1 │ miss │ recompute │ ...``)."""
    rows = []
    for line in stdout.splitlines():
        if line.startswith("│"):
            cells = [c.strip() for c in line.strip("│").split("│")]
            if cells and cells[0].isdigit():
                rows.append(cells)
    return rows


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package
        return False


def test_every_example_is_covered() -> None:
    assert {p.stem for p in EXAMPLES} >= {"multiturn_chat", "research_agent", *EXTRAS}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs_and_prints_per_turn_stats(example: Path, router: RouterProc) -> None:
    extra = EXTRAS.get(example.stem)
    if extra is not None and not _installed(extra):
        pytest.skip(f"{extra} is not installed")
    argv = [sys.executable, str(example), "--base-url", f"{router.url}/v1", "--model", MODEL]
    argv += ["--turns", str(TURNS), "--force-tools", "1", "--max-tokens", "64"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        "PYTHONIOENCODING": "utf-8",  # the table is drawn with box characters
    }
    proc = subprocess.run(
        argv,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        encoding="utf-8",
        errors="replace",
        timeout=TIMEOUT_S,
        check=False,
    )
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-3000:]}\n{proc.stderr[-5000:]}"
    # One "turn N:" line and one "  router: ..." line per turn.
    assert re.findall(r"^turn (\d+):", out, re.M) == [str(n) for n in range(1, TURNS + 1)], out
    router_lines = re.findall(r"^  router: (.+)$", out, re.M)
    assert len(router_lines) == TURNS, out
    assert all(line != "no calls" for line in router_lines), out
    # The per-call table: its header, its conversation, one row per model call (tool steps add rows).
    assert re.search(r"┃ turn ┃ reuse\s+┃ path\s+┃ reused tok ┃", out), out
    assert re.search(r"conversation akv-\S+", out), out
    rows = stats_rows(out)
    assert len(rows) >= TURNS, out
    assert [int(r[0]) for r in rows] == list(range(1, len(rows) + 1)), out
    reuse = [r[1].split(" ")[0] for r in rows]
    assert reuse[0] == "miss", out  # a fresh conversation
    assert set(reuse) <= VERDICTS, out  # every call's verdict came from the router's headers
