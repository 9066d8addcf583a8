"""Conversations with KV-cache reuse: ``Session`` / ``AsyncSession``, per-turn stats, the tool loop."""

from agentkv.session._async_session import AsyncSession
from agentkv.session._core import new_conversation_id
from agentkv.session._delta import Delta, ToolCallDelta
from agentkv.session._research import QUESTIONS, ResearchRun, make_research_tools, run_research_agent
from agentkv.session._session import Session
from agentkv.session._stats import TurnStats
from agentkv.session._tools import RunResult, Tool

__all__ = [
    "QUESTIONS",
    "AsyncSession",
    "Delta",
    "ResearchRun",
    "RunResult",
    "Session",
    "Tool",
    "ToolCallDelta",
    "TurnStats",
    "make_research_tools",
    "new_conversation_id",
    "run_research_agent",
]
