"""Names and defaults shared by the router, the SDK and the connector (one name per concept)."""

from __future__ import annotations

# --- conversation identity -------------------------------------------------------------------------
DEFAULT_SESSION_HEADER = "x-session-id"
ALT_SESSION_HEADERS = ("x-conversation-id",)
# Body fields accepted as the conversation id, in priority order; stripped before forwarding.
BODY_ID_FIELDS = ("conversation_id", "session_id", "prompt_cache_key")
MAX_CONVERSATION_ID_LEN = 128
CONVERSATION_ID_PATTERN = r"^[A-Za-z0-9._:\-]{1,128}$"

# --- response headers the router adds (never internal block ids / hosts) ----------------------------
H_REUSED_TOKENS = "x-agentkv-reused-tokens"
# Of those, the tokens prefill read from decode (absent: a stock prefill, which does not say); the rest came
# from prefill's own prefix cache.
H_PULLED_TOKENS = "x-agentkv-pulled-tokens"
H_REUSE = "x-agentkv-reuse"  # hit | miss | expired | declined | mismatch | none | local | cached
H_PATH = "x-agentkv-path"  # decode-local | pull | recompute | single
# On a turn served from what decode still caches (reuse "cached"): "host" where some of it came back from
# decode's host KV tier (vLLM's OffloadingConnector), else "hbm".
H_TIER = "x-agentkv-tier"
H_LEASE_EXPIRES_IN = "x-agentkv-lease-expires-in"  # seconds, float
H_PREFILL_MS = "x-agentkv-prefill-ms"
# Milliseconds of the render (chat template + tokenizer on prefill's API server) the token path runs once.
H_RENDER_MS = "x-agentkv-render-ms"
H_CONVERSATION_ID = "x-agentkv-conversation-id"
H_FINAL_TURN = "x-agentkv-final-turn"

# --- leases ----------------------------------------------------------------------------------------
DEFAULT_LEASE_S = 30.0
# An SDK session idle this long (no turn) stops heartbeating, so an agent that hangs does not pin KV forever.
DEFAULT_IDLE_LIMIT_S = 600.0
DEFAULT_MAX_LEASE_S = 600.0
VLLM_FIXED_TTL_S = 480.0

# --- engine ----------------------------------------------------------------------------------------
DEFAULT_PREFILL_PORT = 8100
DEFAULT_DECODE_PORT = 8200
DEFAULT_ROUTER_PORT = 8000
# Offset from a decode's HTTP port to its lease (retention) service port, used by the launcher.
LEASE_PORT_OFFSET = 1000
SIDE_CHANNEL_BASE_PORT = 5600
# Key of the token fingerprints our connector adds to decode's kv_transfer_params (absent: a stock decode).
FINGERPRINTS_KEY = "agentkv_block_hashes"
# Prompt tokens our connector on prefill read from decode for a request, in the kv_transfer_params prefill
# answers with (the router takes it off before the decode hop).
PULLED_KEY = "agentkv_pulled_tokens"
# Decode's retention service URL in the kv_transfer_params it offers (prefill's still-held check calls it).
SERVICE_KEY = "agentkv_service"
# Shared secret of decode's retention service: with it set, every call that reads, renews or releases a
# lease needs `Authorization: Bearer <token>`. Environment only (decode, prefill, router alike): vLLM logs
# kv_connector_extra_config and command lines show in `ps`.
SERVICE_TOKEN_ENV = "AGENTKV_SERVICE_TOKEN"


def service_headers(token: str | None) -> dict[str, str]:
    """The headers a retention-service call carries (none without a token)."""
    return {"authorization": f"Bearer {token}"} if token else {}
