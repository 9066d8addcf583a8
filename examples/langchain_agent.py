"""A LangChain tool-calling loop on ``AgentKVChatOpenAI``; needs ``pip install 'agentkv[langchain]'``.

python examples/langchain_agent.py --base-url http://127.0.0.1:8000/v1 --force-tools 1
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from _common import parser
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool

from agentkv.client import first_model
from agentkv.integrations.langchain import AgentKVChatOpenAI
from agentkv.session import QUESTIONS, Session, make_research_tools


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    model = args.model or first_model(args.base_url, api_key=args.api_key)
    with (
        tempfile.TemporaryDirectory() as scratch,
        Session(base_url=args.base_url, model=model, api_key=args.api_key) as session,
    ):
        # The session only carries identity and heartbeats here; LangChain makes the requests.
        tools = {t.name: tool(t.fn) for t in make_research_tools(Path(scratch)) if t.fn is not None}
        llm = AgentKVChatOpenAI.from_session(session, max_tokens=args.max_tokens)
        messages: list = []
        for turn in range(args.turns):
            messages.append(HumanMessage(QUESTIONS[turn % len(QUESTIONS)]))
            for step in range(4):
                forced = step < args.force_tools
                choice = "required" if forced else ("none" if args.force_tools else None)
                reply = llm.bind_tools(list(tools.values()), tool_choice=choice).invoke(messages)
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
            print(f"  router: {reply.response_metadata.get('headers', {}).get('x-agentkv-reuse', 'unknown')}")


if __name__ == "__main__":
    main()
