"""The application's /metrics: every replica's Prometheus series in one exposition, each sample
labelled with its `replica` (the Serve replica id).

Why a union and not sums: gauges such as kv_cache_usage_perc do not add up, and a scraper can
always sum (`sum without (replica) (...)`), never split a sum. Family names stay the replicas'
(`ember:*` and their `vllm:*` mirrors, ember_cupy/server/metrics.py), so vLLM dashboards read
the fleet unchanged.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

REPLICA_LABEL = "replica"


def merge_expositions(texts: dict[str, str]) -> bytes:
    """{replica id: its Prometheus text} -> one Prometheus text (families in first-seen order)."""
    families: dict[str, Metric] = {}
    for replica_id, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type,
                                                        family.unit)
            merged.samples += [s._replace(labels={**s.labels, REPLICA_LABEL: replica_id})
                               for s in family.samples]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


class _Families:
    """A collector yielding fixed metric families."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return iter(self.families)
