"""Many tool-calling agents at once, each on its own AsyncSession, all on one HTTP connection pool.

python examples/many_agents.py --base-url http://127.0.0.1:8000/v1 --agents 8 --turns 3 --force-tools 1

Each agent asks, calls a slow tool (a random pause, as a search or a build would take), and answers; its
session heartbeats decode's lease while the tool runs, so the next turn still finds its KV there. One
`httpx.AsyncClient` serves every session: a client per agent would open its own connections (and build its
own TLS context, ~20 ms each).
"""

from __future__ import annotations

import argparse
import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Annotated

import httpx
from _common import parser, router_line
from pydantic import Field

from agentkv.client import first_model
from agentkv.session import AsyncSession, RunResult, TurnStats

QUESTIONS = [
    "Which files mention the cache?",
    "How many rows does the report have?",
    "What changed in the last build?",
    "Who owns the deployment?",
]


def tool_for(agent: int, pause_s: float) -> Callable[[str], Awaitable[str]]:
    """The agent's tool: a plain async function (its docstring and annotations are the schema). The bound on
    `query` keeps a forced call of a random-weight model within --max-tokens."""
    rng = random.Random(agent)

    async def lookup(query: Annotated[str, Field(max_length=32)]) -> str:
        """Look something up in the project.

        Args:
            query: what to look for
        """
        await asyncio.sleep(rng.uniform(0, pause_s))
        return f"3 results for {query[:40]!r}"

    return lookup


async def agent(
    index: int,
    http: httpx.AsyncClient,
    args: argparse.Namespace,
    model: str,
    results: list[list[RunResult]],
) -> AsyncSession:
    session = AsyncSession(base_url=args.base_url, model=model, api_key=args.api_key, http_client=http)
    lookup = tool_for(index, args.tool_pause_s)
    for turn in range(args.turns):
        question = QUESTIONS[(index + turn) % len(QUESTIONS)]
        result = await session.run(
            question, tools=[lookup], force_tool_steps=args.force_tools, max_tokens=args.max_tokens
        )
        results[turn].append(result)
    await session.aclose()  # decode frees this conversation's KV now, not at lease expiry
    return session


async def main_async() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--tool-pause-s", type=float, default=0.5, help="longest pause of the tool")
    args = p.parse_args()
    model = args.model or first_model(args.base_url, api_key=args.api_key)
    results: list[list[RunResult]] = [[] for _ in range(args.turns)]
    limits = httpx.Limits(max_connections=2 * args.agents, max_keepalive_connections=2 * args.agents)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600, connect=10)) as http:
        sessions = await asyncio.gather(*(agent(i, http, args, model, results) for i in range(args.agents)))
    for turn, runs in enumerate(results, start=1):
        calls: list[TurnStats] = [t for r in runs for t in r.turns]
        print(f"turn {turn}: {len(runs)} agents, {sum(r.steps for r in runs)} model calls")
        print(router_line(calls))
    every = [t for s in sessions for t in s.turns]
    reused = [t for t in every if t.reuse in ("hit", "local")]
    print(f"{len(sessions)} agents, {len(every)} model calls, {len(reused)} reused decode's KV")
    print(sessions[0].summary())


if __name__ == "__main__":
    asyncio.run(main_async())
