"""Conversation shapes agents produce, for the "reuse never changes an answer" suite (issue 5).

Each case drives ``send(messages) -> answer text`` through one conversation id. Run against a reuse-ON and a
reuse-OFF router, the token ids of every request must be identical. ``run_case`` runs one case through one
router and records what it answered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._helpers import Turn, assert_same_answer, chat, conversation_script, new_id

Send = Callable[[list[dict[str, Any]]], str]
Msg = dict[str, Any]


def _u(text: str) -> Msg:
    return {"role": "user", "content": text}


def _a(text: str) -> Msg:
    return {"role": "assistant", "content": text}


def plain_growth(send: Send, s: list[str]) -> None:
    h: list[Msg] = []
    for msg in s[:3]:
        h.append(_u(msg))
        h.append(_a(send(h)))


def edited_earlier_user_message(send: Send, s: list[str]) -> None:
    h = [_u(s[0])]
    h.append(_a(send(h)))
    h.append(_u(s[1]))
    h.append(_a(send(h)))
    # The user fixes a word near the end of their first message; everything after it is unchanged.
    words = s[0].split()
    words[-3] = "edited"
    h[0] = _u(" ".join(words))
    h.append(_u(s[2]))
    send(h)


def regenerated_last_turn(send: Send, s: list[str]) -> None:
    h = [_u(s[0])]
    h.append(_a(send(h)))
    h.append(_u(s[1]))
    first = send(h)
    again = send(h)  # "regenerate": the same request once more
    h.append(_a(again if again else first))
    h.append(_u(s[2]))
    send(h)


def assistant_text_shortened(send: Send, s: list[str]) -> None:
    """Clients strip reasoning / trim answers before sending history back (vLLM issue #43094)."""
    h = [_u(s[0])]
    answer = send(h)
    h.append(_a(answer[len(answer) // 2 :]))
    h.append(_u(s[1]))
    h.append(_a(send(h)))
    h.append(_u(s[2]))
    send(h)


def conversation_id_reused(send: Send, s: list[str]) -> None:
    h = [_u(s[0])]
    send(h)
    other = conversation_script(999, 2, nonce="unrelated")
    h2 = [_u(other[0])]
    h2.append(_a(send(h2)))
    h2.append(_u(other[1]))
    send(h2)


def tool_results_inserted(send: Send, s: list[str]) -> None:
    h = [_u(s[0])]
    h.append(_a(send(h)))
    h.append({"role": "tool", "content": s[1], "tool_call_id": "call_1"})
    h.append(_a(send(h)))
    h.append({"role": "tool", "content": s[2], "tool_call_id": "call_2"})
    send(h)


def history_truncated_from_front(send: Send, s: list[str]) -> None:
    h = [_u(s[0])]
    h.append(_a(send(h)))
    h.append(_u(s[1]))
    h.append(_a(send(h)))
    h = h[2:]  # compaction: drop the oldest exchange
    h.append(_u(s[2]))
    send(h)


CASES = [
    plain_growth,
    edited_earlier_user_message,
    regenerated_last_turn,
    assistant_text_shortened,
    conversation_id_reused,
    tool_results_inserted,
    history_truncated_from_front,
]


Record = list[tuple[int, list[int], list[float], list[dict[int, float]]]]


def run_case(
    case: Callable[..., None], url: str, script: list[str], *, logprobs: bool = True, top: int = 0
) -> tuple[Record, list[str]]:
    """Run one case on one conversation id; return (request index, token ids, their logprobs, top
    logprobs) and the reuse headers. Exact routers are compared on logprobs too (bit for bit);
    ``logprobs=False`` records ids only; ``top`` > 0 records that many top logprobs per token (a reference
    that must tell near ties)."""
    cid = new_id("case")
    record: Record = []
    reuse: list[str] = []

    def send(messages: list[dict[str, object]]) -> str:
        turn = chat(url, messages, conversation_id=cid, extra={"top_logprobs": top} if top else None)
        record.append((len(record), turn.ids, turn.logprobs if logprobs else [], turn.top))
        reuse.append(turn.headers.get("x-agentkv-reuse", ""))
        return turn.text

    case(send, script)
    return record, reuse


def assert_same_records(got: Record, ref: Record, *, bit_exact: bool) -> None:
    """Two runs of a case answered alike: bit for bit where ``bit_exact``, else turn by turn up to rounding
    (``assert_same_answer``)."""
    if bit_exact:
        assert got == ref
        return
    assert len(got) == len(ref), (got, ref)
    for (_, ids, lps, top), (_, ref_ids, ref_lps, ref_top) in zip(got, ref, strict=True):
        assert_same_answer(
            Turn(ids, "", logprobs=lps, top=top),
            Turn(ref_ids, "", logprobs=ref_lps, top=ref_top),
            bit_exact=False,
        )


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the files.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]


def two_turns(
    url: str, second_extra: dict[str, Any], *, first_extra: dict[str, Any] | None = None
) -> tuple[dict[str, str], Any]:
    """A turn, then the next one with `second_extra` in its body (tools, template kwargs): the second turn's
    headers, and its history and answer (for a baseline)."""
    cid = new_id("tokens-top")
    script = conversation_script(33, 2)
    history: list[dict[str, Any]] = [{"role": "user", "content": script[0]}]
    first = chat(url, history, conversation_id=cid, extra=first_extra)
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": script[1]}]
    second = chat(url, history, conversation_id=cid, extra=second_extra)
    return second.headers, (history, second)
