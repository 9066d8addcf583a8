"""Issue 45: a real third-party harness, the OpenAI Agents SDK, runs a multi-turn tool loop through the router
on the real cluster (chat-completions and Responses models), and every model call after the conversation's
first reuses decode's KV.

The SDK needs openai >= 3, which the suite's environment cannot hold (llama-index-llms-openai pins openai
< 3): scripts/test.sh installs it into a side directory, and the client (``_agents_sdk_client.py``, which
says how it drives the tool loop) runs in its own process with that directory on its path.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ._helpers import MODEL, RouterProc, conversation_script, new_id

ROOT = Path(__file__).resolve().parents[2]
# Where scripts/test.sh installs openai-agents and its openai 3 (AGENTKV_AGENTS_SDK_DIR overrides).
_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "agentkv"
SIDE_DIR = Path(
    os.environ.get("AGENTKV_AGENTS_SDK_DIR", _CACHE / "openai-agents-0.24.0-openai-3.57.0-httpx2-2.16.2")
)
CLIENT = Path(__file__).with_name("_agents_sdk_client.py")
TOOL_STEPS = 3
TIMEOUT_S = 240


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_agents_sdk_tool_loop_reuses_decode_kv_after_the_first_call(api: str, router: RouterProc) -> None:
    if not (SIDE_DIR / "agents").is_dir():
        pytest.skip(f"openai-agents is not installed in {SIDE_DIR} (scripts/test.sh installs it)")
    conversation_id = new_id(f"agents-{api}")
    # The same prompt in every run (the id only keys the router): what the model writes is no draw per run.
    prompt = conversation_script(450, 1)[0]
    argv = [sys.executable, str(CLIENT), router.url, MODEL, api, conversation_id, str(TOOL_STEPS), prompt]
    # The side directory first: its openai 3 must shadow the suite's openai 2.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SIDE_DIR), str(ROOT)])}
    proc = subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    calls = summary["calls"]

    # The SDK's loop ran: run 1 made one forced tool call per model call, and ran the tool each time; run 2
    # made one forced tool call, then (chat only, see the client) the SDK reset tool_choice and the model
    # answered in text.
    assert summary["calls_first_run"] == TOOL_STEPS, summary
    assert len(summary["tool_outputs"]) == TOOL_STEPS, summary
    assert all(re.fullmatch(r"(orders|users): 42 rows", out) for out in summary["tool_outputs"]), summary
    assert summary["tool_calls_second_run"] == 1, summary
    assert len(calls) == TOOL_STEPS + (2 if api == "chat" else 1), summary

    # Every call went through, all of them in the one conversation, and each after the first read decode's KV.
    assert [c["status"] for c in calls] == [200] * len(calls), calls
    assert {c["x-agentkv-conversation-id"] for c in calls} == {conversation_id}, calls
    reuse = [c["x-agentkv-reuse"] for c in calls]
    assert reuse == ["miss"] + ["hit"] * (len(calls) - 1), calls
    assert all(int(c["x-agentkv-reused-tokens"]) > 0 for c in calls[1:]), calls
