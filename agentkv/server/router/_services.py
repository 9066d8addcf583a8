"""What every turn of one router app shares: its settings, the conversation store, the engine pools, the
lease client, the hops, the metrics and the learned cost model. Built once by the app; the turn runner,
the conversation endpoints, the relay and the post-turn bookkeeping (`TurnBook`) take it."""

from __future__ import annotations

import dataclasses

from ._backend import BackendPool
from ._hops import Hops
from ._lease import LeaseClient
from ._metrics import RouterMetrics
from ._policy import CostModel
from ._settings import RouterSettings
from ._store import ConversationStore

__all__ = ["RouterServices"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RouterServices:
    settings: RouterSettings
    store: ConversationStore
    metrics: RouterMetrics
    prefill: BackendPool
    decode: BackendPool
    leases: LeaseClient
    hops: Hops
    cost: CostModel = dataclasses.field(default_factory=CostModel)
