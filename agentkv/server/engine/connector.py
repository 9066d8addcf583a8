"""agentkv's vLLM connector, loaded by vLLM through ``kv_connector_module_path``.

    --kv-transfer-config '{"kv_connector": "NixlConnector",
                           "kv_connector_module_path": "agentkv.server.engine.connector", ...}'

The class is named ``NixlConnector`` so vLLM's name-based checks keep treating it as NIXL. It is vLLM's pull
connector with our scheduler and worker (leases, prefix check, cost-based pulls, CPU fixes); settings are
``agentkv_*`` keys of ``kv_connector_extra_config`` (see ``_connector/_config.py``). Import this module only
inside a vLLM process.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from agentkv.server.engine._connector._scheduler import AgentKVScheduler
from agentkv.server.engine._connector._vllm import NixlBaseConnector, NixlPullConnector
from agentkv.server.engine._connector._worker import AgentKVWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["AgentKVScheduler", "AgentKVWorker", "NixlConnector"]

_log = logging.getLogger("agentkv")
if not _log.handlers:
    # vLLM configures only its own loggers; without this our decisions would be invisible in engine logs.
    _handler = logging.StreamHandler()
    _handler.setFormatter(
        logging.Formatter("(agentkv pid=%(process)d) %(levelname)s %(asctime)s %(message)s")
    )
    _log.addHandler(_handler)
    _log.setLevel(logging.INFO)


class NixlConnector(NixlPullConnector):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        # Skip NixlPullConnector.__init__: it would build vLLM's own worker (and NIXL agent) first.
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = AgentKVScheduler(vllm_config, self.engine_id, kv_cache_config)
            self.connector_worker = None
        else:
            self.connector_scheduler = None
            self.connector_worker = AgentKVWorker(vllm_config, self.engine_id, kv_cache_config)
