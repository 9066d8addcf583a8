"""A tool-calling research agent (calculator, file search, sqlite) on one agentkv Session.

python examples/research_agent.py --base-url http://127.0.0.1:8000/v1 --turns 3 --force-tools 1
"""

from __future__ import annotations

from _common import parser, router_line

from agentkv.session import RunResult, run_research_agent


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()

    def show(turn: int, result: RunResult) -> None:
        tools = ", ".join(m["content"][:40] for m in result.tool_messages) or "no tools"
        print(f"turn {turn}: {result.steps} step(s), {result.stop_reason}; tools -> {tools}")
        print(f"  answer: {(result.content or '')[:200]!r}")
        print(router_line(result.turns))

    run = run_research_agent(
        args.base_url,
        args.model,
        turns=args.turns,
        api_key=args.api_key,
        force_tool_steps=args.force_tools,
        max_tokens=args.max_tokens,
        on_turn=show,
    )
    print(run.summary)


if __name__ == "__main__":
    main()
