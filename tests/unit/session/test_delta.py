from openai.types.chat import ChatCompletionChunk

from agentkv.session._delta import MessageAssembler


def chunk(
    delta: dict, finish: str | None = None, usage: dict | None = None, choices: bool = True
) -> ChatCompletionChunk:
    data: dict = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": []}
    if choices:
        data["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish}]
    if usage:
        data["usage"] = usage
    return ChatCompletionChunk.model_validate(data)


def call(index: int, *, id: str | None = None, name: str | None = None, args: str | None = None) -> dict:
    fragment: dict = {"index": index, "function": {}}
    if id:
        fragment["id"] = id
        fragment["type"] = "function"
    if name:
        fragment["function"]["name"] = name
    if args is not None:
        fragment["function"]["arguments"] = args
    return {"tool_calls": [fragment]}


def test_text_and_interleaved_tool_calls_are_assembled_by_index() -> None:
    assembler = MessageAssembler()
    for c in [
        chunk({"role": "assistant", "content": "Let me "}),
        chunk({"content": "check."}),
        chunk(call(1, id="b", name="search", args="")),
        chunk(call(0, id="a", name="calc", args='{"expr')),
        chunk(call(1, args='{"q": "kv"}')),
        chunk(call(0, args='ession": "1+1"}')),
        chunk({}, finish="tool_calls"),
        chunk({}, usage={"prompt_tokens": 7, "completion_tokens": 9, "total_tokens": 16}, choices=False),
    ]:
        assembler.add(c)
    message = assembler.message()
    assert message.content == "Let me check."
    assert [(t.id, t.function.name, t.function.arguments) for t in message.tool_calls or []] == [
        ("a", "calc", '{"expression": "1+1"}'),
        ("b", "search", '{"q": "kv"}'),
    ]
    assert assembler.finish_reason == "tool_calls"
    assert assembler.usage is not None and assembler.usage.completion_tokens == 9


def test_deltas_report_what_arrived() -> None:
    assembler = MessageAssembler()
    assert assembler.add(chunk({"role": "assistant", "content": ""})) is None
    delta = assembler.add(chunk(call(0, id="a", name="calc", args='{"x":')))
    assert (
        delta is not None and delta.tool_calls[0].name == "calc" and delta.tool_calls[0].arguments == '{"x":'
    )


def test_reasoning_is_kept_in_history_form() -> None:
    assembler = MessageAssembler()
    assembler.add(chunk({"reasoning_content": "think"}))
    assembler.add(chunk({"content": "answer"}))
    assert assembler.partial() == {"role": "assistant", "content": "answer", "reasoning_content": "think"}
