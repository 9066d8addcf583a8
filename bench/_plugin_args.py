"""The command-line flags for the reuse legs' engines (agentkv's vLLM plugin, prefill's prefix cache), shared
by the benchmarks that start clusters."""

from __future__ import annotations

import argparse
import json
from typing import Any

from agentkv.server.engine.plugin import DEFAULT_PRIME_TOKENS, FORWARDED_IDS_MODES, TOKENIZER_CACHE_MODES

__all__ = [
    "add_env_arg",
    "add_fast_json_arg",
    "add_kv_config_arg",
    "add_plugin_args",
    "add_prefill_cache_arg",
    "env_item",
    "kv_config_item",
    "plugin_fields",
]


def env_item(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` of an engine environment flag (an argparse ``type``), refused at parse time rather than
    at the engines' start."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def kv_config_item(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` of a ``--kv-config`` flag (an argparse ``type``, split and checked as `env_item` does):
    the value as JSON where it parses (numbers, booleans), else text."""
    key, value = env_item(text)
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def add_env_arg(ap: argparse.ArgumentParser) -> None:
    """`--env KEY=VALUE` (repeatable) for the engines a benchmark starts."""
    ap.add_argument(
        "--env", action="append", default=[], type=env_item, help="KEY=VALUE for the engines (repeat)"
    )


def add_kv_config_arg(ap: argparse.ArgumentParser) -> None:
    """`--kv-config KEY=VALUE` (repeatable) into the P/D engines' ``kv_connector_extra_config``."""
    ap.add_argument(
        "--kv-config",
        action="append",
        default=[],
        type=kv_config_item,
        metavar="KEY=VALUE",
        help="one key of the P/D engines' kv_connector_extra_config (repeatable; the value as JSON, else "
        "a string), e.g. agentkv_block_hash_reuse_tokens=0",
    )


def add_plugin_args(ap: argparse.ArgumentParser) -> None:
    """`--tokenizer-cache`, `--detokenizer-prime-tokens`, `--forwarded-ids`, `--prefill-token` and
    `--fast-json`: the reuse legs' engines run agentkv's plugin with them; the stock legs (vLLM as a user
    runs it without agentkv) never do."""
    ap.add_argument(
        "--tokenizer-cache",
        choices=TOKENIZER_CACHE_MODES,
        default="on",
        help="agentkv's tokenizer cache in the reuse legs' engines (the stock legs always run without it)",
    )
    ap.add_argument(
        "--detokenizer-prime-tokens",
        type=int,
        default=DEFAULT_PRIME_TOKENS,
        help="prompt ids the reuse legs' detokenizers are primed with (0: the whole prompt, as vLLM)",
    )
    ap.add_argument(
        "--forwarded-ids",
        choices=FORWARDED_IDS_MODES,
        default="always",
        help="the reuse legs' decodes run the router's forwarded prompt ids instead of rendering the "
        "messages again: always (agentkv's default) through agentkv's wrapper, which also reads them packed "
        "and takes a body cut to its last message; on: vLLM 0.32+'s own code there",
    )
    ap.add_argument(
        "--prefill-token",
        choices=("on", "off"),
        default="on",
        help="the reuse legs' decodes start from the token prefill sampled (agentkv's AGENTKV_PREFILL_TOKEN; "
        "off: decode computes the prompt's last token again, as vLLM's P/D does)",
    )
    add_fast_json_arg(ap)


def add_fast_json_arg(ap: argparse.ArgumentParser) -> None:
    """`--fast-json`: the plugin's `AGENTKV_FAST_JSON` in the servers a benchmark starts with it."""
    ap.add_argument(
        "--fast-json",
        choices=("on", "off"),
        default="on",
        help="agentkv's AGENTKV_FAST_JSON: vLLM's API server parses request bodies and encodes JSON answers "
        "with msgspec where that gives the standard library's values (off: the standard library, as vLLM)",
    )


def plugin_fields(args: argparse.Namespace, *, reuse: bool) -> dict[str, Any]:
    """The plugin's `ClusterConfig`/`EngineSpec` fields for a leg: the flags above in a reuse leg, vLLM as
    shipped (every part off) in a stock one."""
    if not reuse:
        return {
            "tokenizer_cache": "off",
            "detokenizer_prime_tokens": 0,
            "forwarded_ids": "off",
            "fast_json": False,
            "prefill_token": False,
        }
    return {
        "tokenizer_cache": args.tokenizer_cache,
        "detokenizer_prime_tokens": args.detokenizer_prime_tokens,
        "forwarded_ids": args.forwarded_ids,
        "fast_json": args.fast_json == "on",
        "prefill_token": args.prefill_token == "on",
    }


def add_prefill_cache_arg(ap: argparse.ArgumentParser) -> None:
    """`--prefill-prefix-caching`: the reuse legs' prefill keeps vLLM's prefix cache."""
    ap.add_argument(
        "--prefill-prefix-caching",
        action="store_true",
        help="the reuse legs' prefill keeps vLLM's prefix cache (vLLM's and `agentkv up`'s default): a pull "
        "then reads from decode only what that cache lacks. Without it prefill caches nothing (the published "
        "cache-eviction case) and every reused token comes from decode. OFF never caches; floor always does.",
    )
