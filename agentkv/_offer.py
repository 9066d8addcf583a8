"""Decode's offer (its ``kv_transfer_params``) cut to fewer tokens: shared by the connector and the router.

Pure, no vLLM import: the router runs without the engine installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["cut_offer"]


def cut_offer(params: dict[str, Any], num_tokens: int, block_size: int) -> dict[str, Any]:
    """A copy of ``params`` that offers exactly the first ``num_tokens`` tokens.

    vLLM reads ``remote_num_tokens`` and ``remote_block_ids`` (one list per KV cache group). The block lists
    must end where the tokens do: vLLM's reader end-aligns the remote list to its own blocks
    (``_apply_prefix_caching``: ``remote[-len(local):]``), so one remote block too many shifts every block
    read by one and prefill computes with the KV of other positions.
    """
    n_blocks = -(-num_tokens // block_size)
    return {
        **params,
        "remote_num_tokens": num_tokens,
        "remote_block_ids": [list(g[:n_blocks]) for g in params["remote_block_ids"]],
    }
