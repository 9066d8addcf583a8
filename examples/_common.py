"""Shared command-line flags for the examples."""

from __future__ import annotations

import argparse

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
        help='send tool_choice="required" on the first N steps of each turn (random-weight test '
        'models never call tools by themselves), then tool_choice="none" so each turn answers',
    )
    return p
