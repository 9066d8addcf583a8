"""Worker-side extensions: make NIXL behave on CPU without patching installed packages.

Two problems recorded in shared/docs/cpu-engine.md: (1) the NIXL agent's progress thread is created with a
hard-coded 0 µs delay and busy-spins a core per server; (2) vLLM's CPU path pins the worker thread of every
instance to the same "last core", so a decode that spins starves prefill's worker and the D -> P pull stalls.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from agentkv.server._connector._config import ConnectorSettings
from agentkv.server._connector._vllm import NixlPullConnectorWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["AgentKVWorker", "progress_thread_delay"]

logger = logging.getLogger("agentkv.connector")


@contextlib.contextmanager
def progress_thread_delay(delay_us: int) -> Iterator[None]:
    """While active, NIXL agents are created with a progress-thread delay of at least ``delay_us``.

    The nixl Python API assigns ``pthrDelay = 0`` on its config object before creating the agent; we hand it
    a config subclass whose setter keeps our floor. Scoped to this process and restored on exit.
    """
    from vllm.distributed import nixl_utils

    wrapper = nixl_utils.NixlWrapper
    bind = getattr(sys.modules.get(getattr(wrapper, "__module__", ""), None), "nixlBind", None)
    if delay_us <= 0 or bind is None:
        yield
        return
    base = bind.nixlAgentConfig

    class _Config(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:
            return int(base.pthrDelay.__get__(self))

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:
            base.pthrDelay.__set__(self, max(int(value), delay_us))

    bind.nixlAgentConfig = _Config
    try:
        yield
    finally:
        bind.nixlAgentConfig = base


def _shorten_worker_spin(busy_loop_s: float | None) -> None:
    """Shorten how long this worker busy-waits on vLLM's shared-memory queue after each message.

    vLLM spins ``sched_yield`` for 1 s after every read; while decode retains blocks the engine steps empty
    batches every few ms, so the worker never stops spinning and burns a core for the whole retention
    time. The reader's ``SpinCondition`` already exists when the connector is built (its RPCs arrive
    through that queue); we only change its spin window. Older vLLM without it is left alone.
    """
    # Opt-in only: with a short window a reader can miss the queue's wake-up notification and wait until
    # vLLM's execute timeout (seen with 4 engines on 2 loaded cores: a worker stalled > 60 s, the engine
    # died). vLLM's 1 s window makes that race rare; keep it unless explicitly asked.
    if busy_loop_s is None:
        return
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:
        return
    found = 0
    for obj in gc.get_objects():
        if isinstance(obj, SpinCondition) and getattr(obj, "is_reader", False):
            obj.busy_loop_s = busy_loop_s
            found += 1
    logger.info("agentkv set the worker's queue spin window to %.3fs (%d queue(s))", busy_loop_s, found)


class AgentKVWorker(NixlPullConnectorWorker):
    def __init__(self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig) -> None:
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        settings = ConnectorSettings.from_extra(ktc.kv_connector_extra_config)
        affinity: Any = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        with progress_thread_delay(settings.progress_delay_us):
            super().__init__(vllm_config, engine_id, kv_cache_config)
        _shorten_worker_spin(settings.worker_busy_loop_s)
        if settings.restore_affinity and affinity is not None and os.sched_getaffinity(0) != affinity:
            # vLLM pinned this thread to the last core of each NUMA node, the same core for every instance.
            os.sched_setaffinity(0, affinity)
            logger.info("agentkv restored worker CPU affinity to %s", sorted(affinity))
