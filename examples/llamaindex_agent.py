"""A LlamaIndex tool-calling agent on ``AgentKVLLM``; needs ``pip install 'agentkv[llamaindex]'``.

python examples/llamaindex_agent.py --base-url http://127.0.0.1:8000/v1 --force-tools 1

LlamaIndex's own tool calling (``chat_with_tools``, ``get_tool_calls_from_response``, ``call_tool``) over
the research agent's tools (calculator, file search, sqlite) with the same schemas. Against the
random-weight tiny model of ``agentkv up`` pass ``--force-tools 1``: it never calls a tool by itself.
Prints each turn's model calls as the router saw them and, at the end, the adapter's per-call table.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from _common import parser, router_line
from llama_index.core.llms import ChatMessage
from llama_index.core.tools import FunctionTool
from llama_index.core.tools.calling import call_tool_with_selection

from agentkv.client import first_model
from agentkv.integrations.llamaindex import AgentKVLLM
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
        # The session only carries identity and heartbeats here; LlamaIndex makes the requests.
        tools = [
            FunctionTool.from_defaults(fn=t.fn, name=t.name, description=t.description, fn_schema=t.arguments)
            for t in make_research_tools(Path(scratch))
            if t.fn is not None
        ]
        names = {t.metadata.name for t in tools}
        llm = AgentKVLLM.from_session(session, max_tokens=args.max_tokens, is_function_calling_model=True)
        history = [ChatMessage(role="system", content=SYSTEM)]
        for turn in range(args.turns):
            history.append(ChatMessage(role="user", content=QUESTIONS[turn % len(QUESTIONS)]))
            first_call = len(llm.turns)
            for step in range(MAX_STEPS):
                forced = step < args.force_tools
                # Forced steps send tool_choice="required" (and, LlamaIndex's default, one call per step);
                # after them "none" makes the model answer; without --force-tools it chooses ("auto").
                response = llm.chat_with_tools(
                    tools,
                    chat_history=list(history),
                    tool_required=forced,
                    tool_choice="none" if args.force_tools and not forced else None,
                )
                history.append(response.message)
                calls = llm.get_tool_calls_from_response(response, error_on_no_tool_call=False)
                if not calls:
                    break
                for call in calls:
                    if call.tool_name in names:
                        output = str(call_tool_with_selection(call, tools))  # errors become the content
                    else:
                        output = f'{{"error": "unknown tool {call.tool_name!r}"}}'
                    history.append(
                        ChatMessage(
                            role="tool", content=output, additional_kwargs={"tool_call_id": call.tool_id}
                        )
                    )
            print(f"turn {turn + 1}: {str(history[-1].content)[:200]!r}")
            print(router_line(llm.turns[first_call:]))
        print(llm.summary())


if __name__ == "__main__":
    main()
