"""The KV-cache-aware router: an OpenAI-compatible front for prefill/decode disaggregated vLLM that
reuses the KV cache decode already holds for a conversation.

    settings = RouterSettings(prefill=["http://127.0.0.1:8100"], decode=["http://127.0.0.1:8200"])
    run_router(settings)                 # blocking, uvicorn
    app = create_app(settings)           # or in-process, any ASGI server / test client
"""

from ._app import create_app, run_router
from ._backend import Backend
from ._policy import CostModel, PathDecision, choose_path
from ._redis_store import RedisStore
from ._settings import RouterSettings, Timeouts
from ._store import ConversationRecord, ConversationStore, MemoryStore

__all__ = [
    "Backend",
    "ConversationRecord",
    "ConversationStore",
    "CostModel",
    "MemoryStore",
    "PathDecision",
    "RedisStore",
    "RouterSettings",
    "Timeouts",
    "choose_path",
    "create_app",
    "run_router",
]
