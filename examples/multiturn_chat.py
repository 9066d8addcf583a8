"""A plain multi-turn chat, streamed, on one agentkv Session.

python examples/multiturn_chat.py --base-url http://127.0.0.1:8000/v1 --turns 4
"""

from __future__ import annotations

from _common import parser, router_line

from agentkv.client import first_model
from agentkv.session import Session

PROMPTS = [
    "Explain prefill/decode disaggregation in two sentences.",
    "Why does keeping the KV cache between turns help agents?",
    "What is a lease, in that context?",
    "Summarise our conversation in one line.",
]


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    model = args.model or first_model(args.base_url, api_key=args.api_key)
    with Session(base_url=args.base_url, model=model, api_key=args.api_key, system="Be brief.") as session:
        for turn in range(args.turns):
            prompt = PROMPTS[turn % len(PROMPTS)]
            print(f"\nturn {turn + 1}: > {prompt}")
            for delta in session.stream(prompt, max_tokens=args.max_tokens):
                print(delta.content or "", end="", flush=True)
            print()
            print(router_line(session.turns[-1:]))
        print(session.summary())


if __name__ == "__main__":
    main()
