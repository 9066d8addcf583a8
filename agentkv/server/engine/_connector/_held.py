"""Prefill's "still held?" question to decode's retention service, before any pull.

A lease can be released or expire after the router fetched decode's params; reading freed (possibly reused)
blocks would silently compute with wrong KV, and decode's vLLM never checks a read. So prefill asks first.

The call runs inside prefill's scheduler step, so while it waits no request on this prefill makes progress.
A decode whose service answers (200, 404, 401) costs one local round trip; one that does not answer (host
down, process frozen) costs the whole timeout. Until the router's health checks take that decode out of
rotation (seconds), every offer of it would stall prefill again, so a service that did not answer is not
asked for ``cooldown_s``: its offers are refused at once. Refusing is always safe: prefill recomputes.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from agentkv._constants import SERVICE_KEY, service_headers

__all__ = ["HeldCheck"]

logger = logging.getLogger("agentkv.connector")

# (url, headers, timeout_s) -> the answer's body; raises urllib.error.HTTPError for an answer that is not a
# 2xx and another OSError when no answer came.
Fetch = Callable[[str, dict[str, str], float], bytes]


def _urlopen(url: str, headers: dict[str, str], timeout_s: float) -> bytes:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s) as r:
        return bytes(r.read())


class HeldCheck:
    def __init__(
        self,
        *,
        token: str | None,
        timeout_s: float = 1.0,
        cooldown_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        fetch: Fetch = _urlopen,
    ) -> None:
        self._headers = service_headers(token)
        self._timeout_s = timeout_s
        self._cooldown_s = cooldown_s
        self._clock = clock
        self._fetch = fetch
        self._quiet_until: dict[str, float] = {}  # service URL -> when to ask it again

    def __call__(self, params: dict[str, Any]) -> bool:
        """Whether decode still holds the offered blocks; refreshes `remote_blocks_expiry_time` (the deadline
        prefill's vLLM checks) when it does. Params without a service (stock decode) keep vLLM's own expiry
        check."""
        service = params.get(SERVICE_KEY)
        if not service:
            return True
        rid = params.get("remote_request_id")
        now = self._clock()
        if self._quiet_until.get(service, 0.0) > now:
            return False
        try:
            body = self._fetch(
                f"{service}/agentkv/v1/retained/{rid}?reading=1", self._headers, self._timeout_s
            )
            expiry = json.loads(body)["kv_transfer_params"].get("remote_blocks_expiry_time")
        except urllib.error.HTTPError as exc:
            # The service answered: 404 released or expired, 401 a token mismatch. No read; it stays asked.
            logger.info("agentkv still-held check for %s: HTTP %d", rid, exc.code)
            return False
        except OSError as exc:
            # No answer (timeout, refused, unreachable): no read, and no more stalls for a while.
            self._quiet_until[service] = now + self._cooldown_s
            logger.warning(
                "agentkv still-held check for %s failed (%r): offers of %s refused for %.0f s",
                rid,
                exc,
                service,
                self._cooldown_s,
            )
            return False
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            logger.info("agentkv still-held check for %s: malformed answer (%r)", rid, exc)
            return False
        self._quiet_until.pop(service, None)
        params["remote_blocks_expiry_time"] = expiry
        return True
