"""/metrics: the engine's stats in Prometheus text under vLLM's metric names and types, so
dashboards built for vLLM read paged-chat as they are.

Every value is read from the engine's latest stats snapshot at scrape time, so the token
counters cover every request the engine ran: under `paged-chat --serve`, the TUI's own
tabs as well as the API's requests.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from paged_chat.engine.clients.client_protocol import EngineClient


class EngineCollector(Collector):
    """vLLM's engine metrics, labelled with `model_name` as vLLM labels them."""

    def __init__(self, client: EngineClient, model_name: str) -> None:
        self.client = client
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.client.stats()
        usage = stats.kv_cache_usage or 0.0
        gauges = (("vllm:num_requests_running", "Requests in the running batch.", stats.num_running),
                  ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
                  ("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.", usage))
        counters = (
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             stats.prefix_cache_queried_tokens),
            ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             stats.prefix_cache_hit_tokens),
            ("vllm:num_preemptions", "Requests preempted (blocks taken back) so far.",
             stats.num_preemptions),
            ("vllm:prompt_tokens", "Prompt tokens of the requests run, cached ones included.",
             stats.prompt_tokens_total),
            ("vllm:generation_tokens", "Tokens generated.", stats.generation_tokens_total),
            ("vllm:spec_decode_num_draft_tokens", "Drafted tokens verified.",
             stats.draft_tokens_total),
            ("vllm:spec_decode_num_accepted_tokens", "Drafted tokens accepted.",
             stats.accepted_draft_tokens_total))
        for family, rows in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, documentation, value in rows:
                metric = family(name, documentation, labels=["model_name"])
                metric.add_metric([self.model_name], value)
                yield metric


def metrics_registry(client: EngineClient, model_name: str) -> CollectorRegistry:
    """A registry of its own per server (several can run in one process, as in tests)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(client, model_name))
    return registry

