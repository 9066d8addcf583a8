import json
from pathlib import Path

import respx

from agentkv.client import ScriptedReply, ScriptedRouter, router_headers
from agentkv.session import make_research_tools, run_research_agent

from .conftest import BASE


def test_tools_work_and_the_database_is_read_only(tmp_path: Path) -> None:
    tools = {t.name: t for t in make_research_tools(tmp_path)}
    assert tools["calculator"].invoke('{"expression": "(3 + 4) * 2"}') == 14.0
    assert tools["search_files"].invoke('{"query": "LEASE"}')[0]["file"] == "reuse.txt"
    assert tools["query_database"].invoke('{"sql": "SELECT count(*) FROM cities"}') == [[4]]
    for bad in ('{"sql": "DELETE FROM cities"}', '{"expression": "__import__(\'os\')"}'):
        name = "query_database" if "sql" in bad else "calculator"
        try:
            tools[name].invoke(bad)
        except Exception:
            continue
        raise AssertionError(f"{name} accepted {bad}")


def test_run_research_agent_forces_tools_then_answers(control: respx.MockRouter, tmp_path: Path) -> None:
    router = ScriptedRouter()
    for _ in range(2):
        router.add(
            ScriptedReply.completion(None, tool_calls=[("c1", "calculator", '{"expression": "2+2"}')]),
            ScriptedReply.completion("four", headers=router_headers(reuse="hit", reused_tokens=32)),
        )
    run = run_research_agent(
        BASE, "m", turns=2, workdir=tmp_path, force_tool_steps=1, http_client=router.client(), heartbeat=False
    )
    assert [r.content for r in run.results] == ["four", "four"]
    assert [b.get("tool_choice") for b in router.bodies] == ["required", "none", "required", "none"]
    assert json.loads(router.requests[1].content)["messages"][-1]["content"] == "4.0"
    assert len(run.turns) == 4 and run.conversation_id in run.summary
