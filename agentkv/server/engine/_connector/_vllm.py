"""The vLLM classes we extend, imported in one place (vLLM 0.26-0.34 keep them in the ``nixl`` package;
tests/unit/compat checks every name the connector uses against each release's source)."""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlBaseConnector,
    NixlPullConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker

__all__ = [
    "NixlBaseConnector",
    "NixlPullConnector",
    "NixlPullConnectorScheduler",
    "NixlPullConnectorWorker",
]
