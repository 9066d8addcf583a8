"""agentkv's vLLM general plugin (entry point `vllm.general_plugins`): work in vLLM's API server that grows
with the
whole conversation on every turn, removed. vLLM loads every installed general plugin in each of its
processes; each part here does nothing unless its environment variable is set (the launcher sets them for
the engines it starts).

**The tokenizer cache** (`AGENTKV_TOKENIZER_CACHE` = `on` or `verify`). It wraps
`BaseRenderer._tokenize_prompt`, the one place vLLM 0.26-0.34 tokenizes a rendered prompt (chat, completions,
messages, responses, and the render routes), so that a prompt extending one tokenized before costs only its
new text (`_tokenizer_cache`). Prompts it cannot serve exactly as vLLM would go to vLLM's own code unchanged:
offsets requested, truncation that would cut, tokenizers that are not Hugging Face fast ones or fail the
cache's probe.

Counters on the API server's `/metrics`: `agentkv_tokenizer_cache_prompts_total{result}` (hit, miss,
mismatch: only `verify` finds mismatches), `agentkv_tokenizer_cache_tokens_total{kind}` (reused,
tokenized), `agentkv_detokenizer_tail_primes_total`.

**The detokenizer's prompt tail** (`AGENTKV_DETOKENIZER_PRIME_TOKENS`, a number of ids). vLLM primes each
request's incremental detokenizer (`FastIncrementalDetokenizer`, a `tokenizers.DecodeStream`) with the whole
prompt, and the first output token then decodes all of it: ~130 ms at 127k tokens on the H200 host, on every
hop. Decoding the next token needs only a short left context (a byte-level run spans at most a few ids), so
the stream is primed with the prompt's last N ids instead; upstream proposes the same (vllm-project/vllm#51281
with 32, #57330 with 128).

**Forwarded prompt ids on decode** (`AGENTKV_FORWARDED_IDS` = `always`, agentkv's launcher's default, or `on`
to leave vLLM 0.32+'s own code in place): decode runs the prompt ids the router forwards in
`kv_transfer_params` instead of rendering and tokenizing the messages again, as vLLM 0.32+ does itself
(`_forwarded_ids`); agentkv's wrapper also takes them packed and a body cut to its last message.
Decode's retention service reports the setting (`forwarded_ids` in `/agentkv/v1/info`, and `packed_ids`
where agentkv's wrapper runs and also reads them packed) so that the router sends the ids only where they
are taken, in the cheaper form where it can. Packed ids become vLLM's list with the ints of the longest prefix
a recent prompt shares taken from that prompt's list (`_id_lists`, `AGENTKV_KEPT_PROMPT_IDS` ids kept, 0:
none): an agent's next turn makes ints only for what it adds. On vLLM 0.32+ the list the wrapper checked (or
it and prefill's token) skips vLLM's second vocabulary check (`agentkv_vllm_id_checks_total{result}`).

**Decode starts from prefill's token** (`AGENTKV_PREFILL_TOKEN` = `on`): where the router forwards the
token prefill sampled, decode takes it as its prompt's last id instead of computing that token again, and
puts it back at the answer's front (`_prefill_token`), so that a P/D answer computes what one server
computes. Counted by `agentkv_prefill_tokens_total{result}` (used, or why not).

**JSON through msgspec** (`AGENTKV_FAST_JSON` = `on`): starlette's `Request.json`, which parses every
request body in vLLM's API server, uses msgspec where it can and `json.loads` where msgspec refuses, and
`JSONResponse.render` encodes with msgspec where that gives the standard library's values (`_fast_json`):
half the time for the token path's bodies of 100k+ ids, a twentieth for the render answer that carries
them."""

from agentkv.server.engine.plugin._register import (
    DEFAULT_KEPT_IDS,
    DEFAULT_PRIME_TOKENS,
    ENV_FAST_JSON,
    ENV_FORWARDED_IDS,
    ENV_KEPT_IDS,
    ENV_MAX_MB,
    ENV_MODE,
    ENV_PREFILL_TOKEN,
    ENV_PRIME,
    FORWARDED_IDS_MODES,
    TOKENIZER_CACHE_MODES,
    ForwardedIdsMode,
    TokenizerCacheMode,
    forwarded_ids_mode,
    prompt_tail,
    register,
)

__all__ = [
    "DEFAULT_KEPT_IDS",
    "DEFAULT_PRIME_TOKENS",
    "ENV_FAST_JSON",
    "ENV_FORWARDED_IDS",
    "ENV_KEPT_IDS",
    "ENV_MAX_MB",
    "ENV_MODE",
    "ENV_PREFILL_TOKEN",
    "ENV_PRIME",
    "FORWARDED_IDS_MODES",
    "TOKENIZER_CACHE_MODES",
    "ForwardedIdsMode",
    "TokenizerCacheMode",
    "forwarded_ids_mode",
    "prompt_tail",
    "register",
]
