"""Worker-side extensions: make NIXL behave on CPU without patching installed packages.

Two problems recorded in shared/docs/cpu-engine.md: (1) the NIXL agent's progress thread is created with a
hard-coded 0 µs delay and busy-spins a core per server; (2) vLLM's CPU path pins the worker thread of every
instance to the same "last core", so a decode that spins starves prefill's worker and the D -> P pull stalls.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from vllm.utils.cpu_resource_utils import parse_id_list

from agentkv.server.engine._connector._config import ConnectorSettings
from agentkv.server.engine._connector._queues import tune_queue_readers
from agentkv.server.engine._connector._vllm import NixlPullConnectorWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["AgentKVWorker", "omp_bind_cores", "progress_thread_delay"]

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


def omp_bind_cores(value: str) -> set[int] | None:
    """The cores of a one-rank ``VLLM_CPU_OMP_THREADS_BIND`` ("3", "0-3,6"), read as vLLM's mp executor
    reads it; None for "auto", "nobind", a list per rank ("0|1") or what vLLM's parser refuses, which leaves
    the thread where it was."""
    if not value or "|" in value or value in ("auto", "nobind"):
        return None
    try:
        return set(parse_id_list(value)) or None
    except ValueError:
        return None


class AgentKVWorker(NixlPullConnectorWorker):
    def __init__(self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig) -> None:
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        settings = ConnectorSettings.from_extra(ktc.kv_connector_extra_config)
        affinity: Any = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        with progress_thread_delay(settings.progress_delay_us):
            super().__init__(vllm_config, engine_id, kv_cache_config)
        tune_queue_readers(busy_loop_s=settings.worker_busy_loop_s, max_wait_ms=settings.queue_max_wait_ms)
        if settings.restore_affinity and affinity is not None:
            # vLLM pinned this thread to the last core of each NUMA node, the same core for every instance.
            # In its uniproc executor no worker process was started with the OpenMP binding that
            # VLLM_CPU_OMP_THREADS_BIND names, so this thread, which runs the model, takes those cores here.
            in_process = vllm_config.parallel_config.distributed_executor_backend == "uni"
            bound = omp_bind_cores(os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")) if in_process else None
            target = bound or affinity
            if os.sched_getaffinity(0) != target:
                os.sched_setaffinity(0, target)
                logger.info("agentkv set the model thread's CPU affinity to %s", sorted(target))
