"""An OpenAI Agents SDK tool loop through the router; run by ``test_agents_sdk`` in a subprocess.

``openai-agents`` needs openai >= 3, which cannot live in the suite's environment (llama-index-llms-openai
pins openai < 3), so this script runs with the side directory scripts/test.sh installs on its ``PYTHONPATH``.

Usage: ``python _agents_sdk_client.py ROUTER_URL MODEL API CONVERSATION_ID TOOL_STEPS PROMPT``; ``API`` is
``chat`` (``OpenAIChatCompletionsModel``) or ``responses`` (``OpenAIResponsesModel``). Prints one JSON object:
every model call's status and agentkv headers, the tool calls the SDK ran and the final output of each run.

The tiny model emits random text and never calls a tool by itself, so the loop is driven through the SDK's
own settings, not by faking model output. Run 1: ``tool_choice="required"`` with ``reset_tool_choice=False``
makes every model call a tool call (vLLM constrains the output to one), and a ``tool_use_behavior`` function
ends the run after ``TOOL_STEPS`` tool calls, so the SDK makes ``TOOL_STEPS`` model calls, each re-sending
the growing history with the tool's results. Run 2 continues the conversation with a new user message: one
forced tool call; on chat completions the SDK then resets ``tool_choice`` (its default) and the model answers
in text. The Responses model ends run 2 at that tool call instead: the random model never ends a text answer
before ``max_output_tokens``, vLLM then marks the response ``incomplete``, and the SDK's Responses model
raises on an incomplete response (its chat model takes ``finish_reason="length"`` as an answer).
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any, Literal

import httpx2
from agents import (
    Agent,
    FunctionToolResult,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunConfig,
    RunContextWrapper,
    Runner,
    ToolsToFinalOutputResult,
    function_tool,
)
from openai import AsyncOpenAI

# The headers the router adds to a turn's response (agentkv._constants; not imported: that package's
# dependencies are the main environment's, not this side directory's).
HEADERS = ("x-agentkv-reuse", "x-agentkv-reused-tokens", "x-agentkv-path", "x-agentkv-conversation-id")


@function_tool
def lookup(table: Literal["orders", "users"]) -> str:
    """Look up a table.

    Args:
        table: which table
    """
    # An enum keeps the forced call's JSON short: the random-weight model would otherwise write digits until
    # max_tokens and the call would never parse.
    return f"{table}: 42 rows"


async def main(
    router_url: str, model_name: str, api: str, conversation_id: str, tool_steps: int, prompt: str
) -> None:
    calls: list[dict[str, Any]] = []

    async def record(response: httpx2.Response) -> None:
        if response.request.url.path.endswith(("/chat/completions", "/responses")):
            calls.append({"status": response.status_code, **{h: response.headers.get(h) for h in HEADERS}})

    http = httpx2.AsyncClient(event_hooks={"response": [record]}, timeout=120)
    # No retries: a failed call must show as a failure, not be hidden behind a second attempt.
    client = AsyncOpenAI(base_url=f"{router_url}/v1", api_key="unused", http_client=http, max_retries=0)
    model = (
        OpenAIChatCompletionsModel(model=model_name, openai_client=client)
        if api == "chat"
        else OpenAIResponsesModel(model=model_name, openai_client=client)
    )
    settings = ModelSettings(
        tool_choice="required",
        # One call per step: vLLM's constraint then ends the forced call where the schema does.
        parallel_tool_calls=False,
        max_tokens=64,
        temperature=0,
        # The conversation id the router keys decode's KV by.
        extra_headers={"x-session-id": conversation_id},
    )
    ran: list[str] = []

    def stop_after_steps(
        ctx: RunContextWrapper[Any], results: list[FunctionToolResult]
    ) -> ToolsToFinalOutputResult:
        ran.extend(str(r.output) for r in results)
        if len(ran) >= tool_steps:
            return ToolsToFinalOutputResult(is_final_output=True, final_output=ran[-1])
        return ToolsToFinalOutputResult(is_final_output=False)

    agent = Agent(
        name="looker",
        instructions="Look up the tables the user asks about, then answer.",
        tools=[lookup],
        model=model,
        model_settings=settings,
        reset_tool_choice=False,
        tool_use_behavior=stop_after_steps,
    )
    config = RunConfig(tracing_disabled=True)
    first = await Runner.run(agent, prompt, run_config=config, max_turns=tool_steps + 1)
    calls_first = len(calls)
    # Run 2: the SDK's default reset_tool_choice on the history of run 1 plus a new user message.
    follow_up = agent.clone(
        tool_use_behavior="run_llm_again" if api == "chat" else "stop_on_first_tool", reset_tool_choice=True
    )
    history = [*first.to_input_list(), {"role": "user", "content": "And the users table again?"}]
    second = await Runner.run(follow_up, history, run_config=config, max_turns=4)
    await http.aclose()
    summary = {
        "calls": calls,
        "calls_first_run": calls_first,
        "tool_outputs": ran,
        "tool_calls_second_run": sum(1 for item in second.new_items if item.type == "tool_call_item"),
        "final_outputs": [str(first.final_output), str(second.final_output)],
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    url, model_name, api, conversation_id, steps, prompt = sys.argv[1:7]
    asyncio.run(main(url, model_name, api, conversation_id, int(steps), prompt))
