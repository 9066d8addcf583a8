"""Issue 45: a framework that sends stop sequences on every call runs a multi-turn tool loop through the
router on the real cluster, and every model call after the conversation's first reuses decode's KV.

The framework is LangChain's ReAct agent (``langchain_classic.agents.create_react_agent`` under its
``AgentExecutor``): it binds ``stop=["\\nObservation"]`` to the model, so every call ends on a client stop
string. vLLM then aborts the request in its engine core, and NixlConnector keeps nothing of an aborted
request; decode's connector keeps it (``_kept_if_cut``), and the next call, whose prompt starts with the same
tokens up to where the agent appended its scratchpad, reuses the whole blocks they share.

The tiny model writes random text and would never write a ReAct step by itself, so the agent's own LLM is
given vLLM's structured output (a regex, sent as ``extra_body`` through ``ChatOpenAI``) that makes each
answer a ReAct action. The regex runs on past the stop string, so every call ends on the stop string the
framework sent, not on the end of the regex; the agent parses the action, runs the tool, and sends the
history again with the observation appended. The same agent runs through the reuse-OFF router, and, both
routers being exact, every answer must be the same text.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from ._helpers import MODEL, RouterProc, new_id

STEPS = 3
STOP = "\nObservation"
# Each answer: one action on the "lookup" tool. "Observation" and the text after it are there so the regex
# does not end first: the call must end on the agent's stop string.
ACTION = r"Thought: [a-z]{1,6}\nAction: lookup\nAction Input: (orders|users)\nObservation: [a-z ]{4,40}"
HEADERS = ("x-agentkv-reuse", "x-agentkv-reused-tokens", "x-agentkv-conversation-id")
# A ReAct prompt in the words of LangChain's hub prompt (hwchase17/react), with a long preamble so that the
# shared prefix spans many of decode's blocks.
TEMPLATE = (
    "You are an operator of a small shop's database. "
    + " ".join(
        f"Rule {i}: check the {t} table before answering." for i, t in enumerate(["orders", "users"] * 30)
    )
    + "\n\nAnswer the following questions as best you can. You have access to the following tools:\n\n"
    "{tools}\n\nUse the following format:\n\nQuestion: the input question you must answer\n"
    "Thought: you should always think about what to do\nAction: the action to take, should be one of "
    "[{tool_names}]\nAction Input: the input to the action\nObservation: the result of the action\n"
    "... (this Thought/Action/Action Input/Observation can repeat N times)\nThought: I now know the final "
    "answer\nFinal Answer: the final answer to the original input question\n\nBegin!\n\n"
    "Question: {input}\nThought:{agent_scratchpad}"
)


def _answer(response: httpx.Response) -> tuple[str, str | None]:
    """The answer's text and finish reason, from a JSON body or from the SSE stream LangChain's agent
    asks for."""
    if not response.headers.get("content-type", "").startswith("text/event-stream"):
        choice = response.json()["choices"][0]
        return choice["message"]["content"] or "", choice["finish_reason"]
    text, finish = "", None
    for line in response.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[len("data: ") :]).get("choices") or []:
            text += (choice.get("delta") or {}).get("content") or ""
            finish = choice.get("finish_reason") or finish
    return text, finish


def _run_agent(router: RouterProc, conversation_id: str) -> tuple[list[dict[str, Any]], list[Any]]:
    """One AgentExecutor run of ``STEPS`` model calls; returns every call's headers and answer, and the
    agent's steps (action, observation)."""
    from langchain_classic.agents import AgentExecutor, create_react_agent
    from langchain_core.prompts import PromptTemplate
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    calls: list[dict[str, Any]] = []

    def record(response: httpx.Response) -> None:
        if response.request.url.path.endswith("/chat/completions"):
            response.read()
            text, finish = _answer(response) if response.status_code == 200 else ("", None)
            calls.append(
                {
                    "status": response.status_code,
                    **{h: response.headers.get(h) for h in HEADERS},
                    "stop_sent": json.loads(response.request.content).get("stop"),
                    "finish_reason": finish,
                    "text": text,
                }
            )

    @tool
    def lookup(table: str) -> str:
        """Count the rows of a table (orders or users)."""
        return f"{table.strip()}: 42 rows"

    with httpx.Client(event_hooks={"response": [record]}, timeout=120) as http:
        llm = ChatOpenAI(
            base_url=f"{router.url}/v1",
            api_key="unused",
            model=MODEL,
            temperature=0,
            max_tokens=96,
            max_retries=0,  # a failed call must show as a failure, not be hidden behind a second attempt
            http_client=http,
            default_headers={"x-session-id": conversation_id},
            extra_body={"structured_outputs": {"regex": ACTION}},
        )
        agent = create_react_agent(llm, [lookup], PromptTemplate.from_template(TEMPLATE))
        executor = AgentExecutor(
            agent=agent, tools=[lookup], max_iterations=STEPS, return_intermediate_steps=True
        )
        result = executor.invoke({"input": "How many orders and how many users are there?"})
    return calls, result["intermediate_steps"]


def test_react_agent_with_stop_sequences_reuses_decode_kv_after_the_first_call(
    router: RouterProc, router_off: RouterProc, bit_exact: bool
) -> None:
    calls, steps = _run_agent(router, new_id("react-on"))

    # The framework's loop ran: STEPS model calls, each sent with the agent's stop string, each ended by it
    # (the text stops where "\nObservation" began), and each parsed into a tool call the agent ran.
    assert len(calls) == STEPS, calls
    assert [c["status"] for c in calls] == [200] * STEPS, calls
    assert all(c["stop_sent"] == [STOP] for c in calls), calls
    assert all(c["finish_reason"] == "stop" and "Observation" not in c["text"] for c in calls), calls
    assert [obs for _, obs in steps] == [f"{a.tool_input.strip()}: 42 rows" for a, _ in steps], steps
    assert len(steps) == STEPS, steps

    # One conversation, and every call after the first read decode's KV: the blocks the previous call's
    # prompt shares with this one, kept on decode though the previous call ended on a stop string.
    assert len({c["x-agentkv-conversation-id"] for c in calls}) == 1, calls
    assert [c["x-agentkv-reuse"] for c in calls] == ["miss"] + ["hit"] * (STEPS - 1), calls
    assert all(int(c["x-agentkv-reused-tokens"]) > 0 for c in calls[1:]), calls

    # Exact mode on both routers: the agent's run through reuse OFF writes the same answers (where this
    # host's kernels let exact mode be bit-identical at all: `split_invariant`; else the OFF run is still
    # made, and must be a full tool loop of its own).
    calls_off, steps_off = _run_agent(router_off, new_id("react-off"))
    assert len(calls_off) == STEPS and len(steps_off) == STEPS, calls_off
    if bit_exact:
        assert [c["text"] for c in calls] == [c["text"] for c in calls_off]
        assert [(a.tool_input, obs) for a, obs in steps] == [(a.tool_input, obs) for a, obs in steps_off]
