"""Shared command-line flags and per-turn output for the examples."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from agentkv.session import TurnStats

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--base-url", default=DEFAULT_BASE_URL, help="router (or any OpenAI-compatible) URL")
    p.add_argument("--model", default=None, help="default: the first model GET /v1/models lists")
    p.add_argument("--api-key", default=None, help="default: $AGENTKV_API_KEY or $OPENAI_API_KEY")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--force-tools",
        type=int,
        default=0,
        metavar="N",
        help='send tool_choice="required" (one call per step) on the first N steps of each turn '
        '(random-weight test models never call tools by themselves), then tool_choice="none" so each '
        "turn answers; the tool examples only",
    )
    return p


def router_line(calls: Sequence[TurnStats]) -> str:
    """One agent turn's model calls as the router saw them: reuse verdict, path, reused tokens."""
    parts = [f"{t.reuse} ({t.path or '-'}, {t.reused_tokens or 0} reused tok)" for t in calls]
    return "  router: " + (" -> ".join(parts) or "no calls")
