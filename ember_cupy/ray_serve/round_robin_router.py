"""Round-robin replica choice: the baseline prefix-aware routing is measured against."""
from __future__ import annotations

import itertools

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica


class RoundRobinRouter(FIFOMixin, RequestRouter):

    def initialize_state(self):
        self._turn = itertools.count()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        start = next(self._turn) % len(ordered)
        # one replica per rank: within a rank Serve would take the shortest queue instead
        return [[r] for r in ordered[start:] + ordered[:start]]
