"""The plugin's Prometheus counters, on vLLM's API server `/metrics`: one module that the plugin's parts
import, so none of them imports the plugin's entry point back."""

from __future__ import annotations

import functools
import logging

__all__ = ["_counters"]

logger = logging.getLogger("vllm.agentkv.tokenizer_cache")


class _Counters:
    def __init__(self) -> None:
        from prometheus_client import Counter

        self.prompts = Counter(
            "agentkv_tokenizer_cache_prompts", "Prompts tokenized through the prefix cache", ["result"]
        )
        self.tokens = Counter("agentkv_tokenizer_cache_tokens", "Prompt ids reused or tokenized", ["kind"])
        self.tail_primes = Counter(
            "agentkv_detokenizer_tail_primes", "Detokenizers primed with the prompt's tail, not all of it"
        )
        self.forwarded_ids = Counter(
            "agentkv_forwarded_ids_prompts",
            "Chat prompts run from the router's forwarded ids (`_forwarded_ids`), by form: list or packed",
            ["form"],
        )
        self.cut_conversations = Counter(
            "agentkv_cut_conversations",
            "Of those, chat requests the router cut to their last message (`agentkv._wire.cut_messages`)",
        )
        self.id_ints = Counter(
            "agentkv_forwarded_id_ints",
            "Packed forwarded ids made into the list vLLM takes, by kind: reused (the int of a kept prompt's "
            "shared prefix) or made",
            ["kind"],
        )
        self.id_checks = Counter(
            "agentkv_vllm_id_checks",
            "vLLM's vocabulary checks of a prompt's ids (0.32+), by result: skipped (a list agentkv's "
            "wrapper checked) or run",
            ["result"],
        )
        self.prefill_tokens = Counter(
            "agentkv_prefill_tokens",
            "Requests that came with prefill's token (`_prefill_token`): used, or why vLLM's own path ran",
            ["result"],
        )

    def __call__(self, result: str, reused: int, tokenized: int) -> None:
        self.prompts.labels(result=result).inc()
        self.tokens.labels(kind="reused").inc(reused)
        self.tokens.labels(kind="tokenized").inc(tokenized)


@functools.cache
def _counters() -> _Counters | None:
    try:
        return _Counters()
    except Exception:  # metrics are a convenience; a name clash must not stop serving
        logger.warning("agentkv plugin: counters not registered", exc_info=True)
        return None
