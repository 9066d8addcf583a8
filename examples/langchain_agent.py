"""A LangChain tool-calling loop on ``AgentKVChatOpenAI``; needs ``pip install 'agentkv[langchain]'``.

python examples/langchain_agent.py --base-url http://127.0.0.1:8000/v1 --force-tools 1

The tools are the research agent's (calculator, file search, sqlite), with the same schemas. Against the
random-weight tiny model of ``agentkv up`` pass ``--force-tools 1``: it never calls a tool by itself.
Prints each turn's model calls as the router saw them and, at the end, the adapter's per-call table.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from _common import parser, router_line
from langchain_core.messages import BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import StructuredTool

from agentkv.client import first_model
from agentkv.integrations.langchain import AgentKVChatOpenAI
from agentkv.session import QUESTIONS, Session, make_research_tools

SYSTEM = "You are a research assistant. Use the tools, then answer concisely."
MAX_STEPS = 4


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    model = args.model or first_model(args.base_url, api_key=args.api_key)
    with (
        tempfile.TemporaryDirectory() as scratch,
        Session(base_url=args.base_url, model=model, api_key=args.api_key) as session,
    ):
        # The session only carries identity and heartbeats here; LangChain makes the requests.
        tools = {
            t.name: StructuredTool.from_function(
                t.fn, name=t.name, description=t.description, args_schema=t.arguments
            )
            for t in make_research_tools(Path(scratch))
            if t.fn is not None
        }
        llm = AgentKVChatOpenAI.from_session(session, max_tokens=args.max_tokens)
        # One call per forced step, as Session.run does: a random model would otherwise keep adding calls.
        single: dict[str, Any] = {"parallel_tool_calls": False} if args.force_tools else {}
        messages: list[BaseMessage] = [SystemMessage(SYSTEM)]
        for turn in range(args.turns):
            messages.append(HumanMessage(QUESTIONS[turn % len(QUESTIONS)]))
            first_call = len(llm.turns)
            for step in range(MAX_STEPS):
                forced = step < args.force_tools
                # After the forced steps "none" makes the model answer; without --force-tools it chooses.
                choice = "required" if forced else ("none" if args.force_tools else None)
                reply = llm.bind_tools(list(tools.values()), tool_choice=choice, **single).invoke(messages)
                messages.append(reply)
                if not reply.tool_calls:
                    break
                for call in reply.tool_calls:
                    try:
                        output = str(tools[call["name"]].invoke(call["args"]))
                    except Exception as exc:  # the model reads the error, as in Session.run
                        output = f'{{"error": "{type(exc).__name__}: {exc}"}}'
                    messages.append(ToolMessage(output, tool_call_id=call["id"]))
            print(f"turn {turn + 1}: {str(messages[-1].content)[:200]!r}")
            print(router_line(llm.turns[first_call:]))
        print(llm.summary())


if __name__ == "__main__":
    main()
