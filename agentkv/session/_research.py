"""A small research agent with local tools; the workload behind ``agentkv demo`` and the example.

Tools: a calculator, a text search over a directory of notes, and a read-only SQL query over a
sqlite database the agent creates. With a random-weights test model the model never chooses a tool
by itself: ``force_tool_steps`` sends ``tool_choice="required"`` on the first steps of each turn, and
later steps use ``tool_choice="none"`` so each turn ends with an answer.
"""

from __future__ import annotations

import ast
import operator
import sqlite3
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field

from agentkv.client import first_model
from agentkv.session._session import Session
from agentkv.session._stats import TurnStats
from agentkv.session._tools import RunResult, Tool

__all__ = ["ResearchRun", "make_research_tools", "run_research_agent"]

SYSTEM = (
    "You are a research assistant. Use the tools to look things up in the local notes and the "
    "database, compute with the calculator, and answer concisely."
)
QUESTIONS = (
    "Which city in the database has the largest population, and by how much does it exceed the smallest?",
    "Search the notes for 'prefill' and summarise what they say.",
    "What is the average population of the cities in the database? Use the calculator.",
    "Which notes mention 'lease', and what is the default lease length?",
    "How many cities are in the database, and what is their total population?",
)
NOTES = {
    "disaggregation.txt": "Prefill computes the prompt's KV cache; decode generates tokens.\n"
    "Splitting them lets each scale on its own hardware.",
    "reuse.txt": "Decode keeps a conversation's KV after a turn under a lease (default 30 s).\n"
    "The next turn's prefill pulls it over NIXL instead of recomputing it.",
    "tools.txt": "Agents pause between turns to run tools; the lease must outlive the pause.",
}
CITIES = [("Lisbon", 545_000), ("Porto", 232_000), ("Braga", 193_000), ("Coimbra", 140_000)]
_OPS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.Mod: operator.mod,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _evaluate(node: ast.AST) -> float:
    # An AST walk instead of eval(): the expression comes from a model.
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return float(_OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right)))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return float(_OPS[type(node.op)](_evaluate(node.operand)))
    raise ValueError(f"unsupported expression element: {ast.dump(node)[:60]}")


def prepare_workdir(workdir: Path) -> Path:
    """Write the notes and the sqlite database the tools read; returns the database path."""
    workdir.mkdir(parents=True, exist_ok=True)
    for name, text in NOTES.items():
        (workdir / name).write_text(text + "\n", encoding="utf-8")
    database = workdir / "cities.sqlite"
    with sqlite3.connect(database) as db:
        db.execute("CREATE TABLE IF NOT EXISTS cities (name TEXT PRIMARY KEY, population INTEGER)")
        db.executemany("INSERT OR REPLACE INTO cities VALUES (?, ?)", CITIES)
    return database


def make_research_tools(workdir: Path) -> list[Tool]:
    database = prepare_workdir(workdir)

    def calculator(expression: Annotated[str, Field(max_length=40)]) -> float:
        """Evaluate an arithmetic expression.

        Args:
            expression: numbers with + - * / ** % and parentheses, e.g. "(3 + 4) * 2".
        """
        return _evaluate(ast.parse(expression, mode="eval"))

    def search_files(query: Annotated[str, Field(max_length=32)], max_hits: int = 5) -> list[dict[str, Any]]:
        """Case-insensitive search of the local notes.

        Args:
            query: text to look for.
            max_hits: the most matching lines to return.
        """
        hits = []
        for path in sorted(workdir.glob("*.txt")):
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
                if query.lower() in line.lower():
                    hits.append({"file": path.name, "line": number, "text": line})
        return hits[:max_hits]

    def query_database(sql: Annotated[str, Field(max_length=60)]) -> list[list[Any]]:
        """Run a read-only SQL query on the `cities(name TEXT, population INTEGER)` table.

        Args:
            sql: one SELECT statement.
        """
        # mode=ro: the model writes the SQL, so the database is opened read-only.
        with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as db:
            return [list(row) for row in db.execute(sql).fetchmany(50)]

    # Bounded string arguments keep a forced call short enough to finish within max_tokens even when the
    # model (the random-weight tiny one) never closes a string by itself; they also suit these tools.
    return [Tool.from_function(f) for f in (calculator, search_files, query_database)]


@dataclass(frozen=True)
class ResearchRun:
    conversation_id: str
    results: list[RunResult]
    turns: list[TurnStats]
    summary: str


def run_research_agent(
    base_url: str,
    model: str | None = None,
    *,
    turns: int = 3,
    api_key: str | None = None,
    workdir: Path | None = None,
    force_tool_steps: int = 0,
    max_steps: int = 4,
    max_tokens: int = 64,
    on_turn: Callable[[int, RunResult], None] | None = None,
    **session_options: Any,
) -> ResearchRun:
    """Run ``turns`` research questions through one ``Session``; returns results and stats."""
    model = model or first_model(base_url, api_key=api_key)
    with tempfile.TemporaryDirectory(prefix="agentkv-research-") as scratch:
        tools = make_research_tools(workdir or Path(scratch))
        results: list[RunResult] = []
        with Session(
            base_url=base_url, model=model, api_key=api_key, system=SYSTEM, **session_options
        ) as session:
            for index in range(turns):
                result = session.run(
                    QUESTIONS[index % len(QUESTIONS)],
                    tools=tools,
                    max_steps=max_steps,
                    force_tool_steps=force_tool_steps,
                    # After the forced steps, "none" makes the model answer: a random model
                    # under "auto" would need a tool parser on the server and might never stop.
                    tool_choice="none" if force_tool_steps else None,
                    # One call per forced step: a random model would otherwise keep adding calls.
                    **({"parallel_tool_calls": False} if force_tool_steps else {}),
                    max_tokens=max_tokens,
                )
                results.append(result)
                if on_turn is not None:
                    on_turn(index + 1, result)
            return ResearchRun(session.conversation_id, results, list(session.turns), session.summary())
