"""Prefix-aware replica choice (SGLang's cache-aware policy) as a Ray Serve request router.

Each request carries its routing key (routing_key.py: the chain hashes of its prompt's full token
blocks, salted). The router remembers, per replica, the block hashes it has sent there (LRU, capped
like a KV pool), which approximates what that replica's prefix cache holds. For each request:
1. if the replicas' loads are unbalanced (max - min > balance_abs_threshold and
   max > balance_rel_threshold x min), take the least loaded: cache affinity must not pile up a queue;
2. else take the replica whose remembered hashes match the longest run of the key's leading blocks,
   if that run is at least match_threshold of the key (and at least one block);
3. else the least loaded one (ties: the one remembering least, so new prefixes spread out).
A replica's load is the larger of what the router has in flight there and the engine's own queue
(running + waiting, from the replica's record_routing_stats); Serve may still skip a full replica
(max_ongoing_requests), so the rest follow in load order.
"""
from __future__ import annotations

from collections import OrderedDict

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica


class PrefixAwareRouter(FIFOMixin, RequestRouter):

    def initialize_state(self, balance_abs_threshold: int = 4, balance_rel_threshold: float = 1.5,
                         match_threshold: float = 0.5, max_blocks_per_replica: int = 65536):
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.match_threshold = match_threshold
        self.max_blocks_per_replica = max_blocks_per_replica
        self.remembered: dict[ReplicaID, OrderedDict[bytes, None]] = {}
        self.in_flight: dict[ReplicaID, int] = {}
        self.routed: dict[str, ReplicaID] = {}   # internal request id -> its replica, until completed

    # --- choice ---------------------------------------------------------------------------
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_load = sorted(candidate_replicas, key=lambda r: (self.load(r), len(self._memory(r.replica_id))))
        key = _routing_key(pending_request)
        if not key or self._unbalanced(by_load):
            return [by_load]
        best = max(by_load, key=lambda r: self.matched_blocks(r.replica_id, key))   # first of equals: least loaded
        matched = self.matched_blocks(best.replica_id, key)
        if matched and matched >= self.match_threshold * len(key):
            return [[best], [r for r in by_load if r is not best]]
        return [by_load]

    def load(self, replica: RunningReplica) -> int:
        stats = replica.routing_stats or {}
        engine_queue = stats.get("num_running", 0) + stats.get("num_waiting", 0)
        return max(engine_queue, self.in_flight.get(replica.replica_id, 0))

    def _unbalanced(self, by_load: list[RunningReplica]) -> bool:
        low, high = self.load(by_load[0]), self.load(by_load[-1])
        return high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low

    def matched_blocks(self, replica_id: ReplicaID, key: tuple[bytes, ...]) -> int:
        memory = self.remembered.get(replica_id)
        if not memory:
            return 0
        matched = 0
        for block_hash in key:   # chain hashes: a block matches only if every block before it did
            if block_hash not in memory:
                break
            matched += 1
        return matched

    # --- bookkeeping (Serve's callbacks) ----------------------------------------------------
    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        memory = self._memory(replica_id)
        for block_hash in _routing_key(pending_request):
            memory[block_hash] = None
            memory.move_to_end(block_hash)
        while len(memory) > self.max_blocks_per_replica:
            memory.popitem(last=False)
        self.in_flight[replica_id] = self.in_flight.get(replica_id, 0) + 1
        self.routed[pending_request.metadata.internal_request_id] = replica_id

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self.routed.pop(internal_request_id, None) is not None and self.in_flight.get(replica_id):
            self.in_flight[replica_id] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID):
        """A restarted replica starts with an empty cache: forget what it held."""
        super().on_replica_actor_died(replica_id)
        self.remembered.pop(replica_id, None)
        self.in_flight.pop(replica_id, None)

    def _memory(self, replica_id: ReplicaID) -> OrderedDict[bytes, None]:
        return self.remembered.setdefault(replica_id, OrderedDict())


def _routing_key(pending_request: PendingRequest | None) -> tuple[bytes, ...]:
    if pending_request is None:
        return ()
    return tuple(pending_request.kwargs.get("routing_key") or ())
