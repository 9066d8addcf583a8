"""Framework adapters. ``langchain`` and ``llamaindex`` are submodules imported on demand (each
needs its extra); the context-variable hook below works with any httpx-based client."""

from agentkv.integrations._context import current_conversation, httpx_event_hooks, use_conversation

__all__ = ["current_conversation", "httpx_event_hooks", "use_conversation"]
