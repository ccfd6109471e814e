"""/metrics: the engine's stats in Prometheus text under vLLM's metric names and types, so
dashboards built for vLLM read paged-chat as they are.

Gauges and the prefix-cache and preemption counters are read from the engine's latest
stats snapshot at scrape time. The engine keeps no running totals of tokens, so the
server counts the prompt and generation tokens of the requests it serves (`TokenCounts`):
under `paged-chat --serve`, the TUI's own tabs are not in those two counters.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from paged_chat.engine.client import EngineClient


@dataclass(slots=True)
class TokenCounts:
    """Tokens of the requests this server has run (monotonic, as counters must be)."""

    prompt: int = 0
    generation: int = 0


class EngineCollector(Collector):
    """vLLM's engine metrics, labelled with `model_name` as vLLM labels them."""

    def __init__(self, client: EngineClient, model_name: str, tokens: TokenCounts) -> None:
        self.client = client
        self.model_name = model_name
        self.tokens = tokens

    def collect(self) -> Iterator[Metric]:
        stats = self.client.stats()
        usage = stats.blocks_in_use / stats.num_blocks if stats.num_blocks else 0.0
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
            ("vllm:prompt_tokens", "Prompt tokens of the served requests.", self.tokens.prompt),
            ("vllm:generation_tokens", "Generated tokens of the served requests.",
             self.tokens.generation))
        for family, rows in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, documentation, value in rows:
                metric = family(name, documentation, labels=["model_name"])
                metric.add_metric([self.model_name], value)
                yield metric


def metrics_registry(client: EngineClient, model_name: str, tokens: TokenCounts
                     ) -> CollectorRegistry:
    """A registry of its own per server (several can run in one process, as in tests)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(client, model_name, tokens))
    return registry

