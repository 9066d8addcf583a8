"""A LlamaIndex chat on ``AgentKVLLM``; needs ``pip install 'agentkv[llamaindex]'``.

python examples/llamaindex_agent.py --base-url http://127.0.0.1:8000/v1 --turns 3
"""

from __future__ import annotations

from _common import parser
from llama_index.core.llms import ChatMessage

from agentkv.client import first_model
from agentkv.integrations.llamaindex import AgentKVLLM
from agentkv.session import QUESTIONS, Session


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    model = args.model or first_model(args.base_url, api_key=args.api_key)
    with Session(base_url=args.base_url, model=model, api_key=args.api_key) as session:
        llm = AgentKVLLM.from_session(session, max_tokens=args.max_tokens)
        history = [ChatMessage(role="system", content="Be brief.")]
        for turn in range(args.turns):
            history.append(ChatMessage(role="user", content=QUESTIONS[turn % len(QUESTIONS)]))
            reply = llm.chat(history)
            history.append(reply.message)
            print(f"turn {turn + 1}: {str(reply.message.content)[:200]!r}")


if __name__ == "__main__":
    main()
