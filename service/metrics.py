"""Prometheus metrics: engine gauges from the latest step's stats, request histograms from streams.

Names follow vLLM's (with our prefix) so dashboards port over. One registry per app.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from service.streams import RequestStream

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus' text format
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)


class EngineStatsCollector:
    """Reads the bridge's latest engine stats snapshot at scrape time.

    Beside ours, the gauges that Kubernetes routers read from vLLM servers (the Gateway API
    Inference Extension's endpoint picker, llm-d): `vllm:num_requests_running`,
    `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (a fraction, 1 = full) and
    `vllm:cache_config_info`, labelled by `model_name` as vLLM labels them.
    """

    def __init__(self, get_stats: Callable[[], dict], model_name: str = "") -> None:
        self.get_stats = get_stats
        self.model_name = model_name

    def collect(self):
        stats = self.get_stats()
        gauges = {
            "pagedserve_num_requests_running": ("Sequences in the running batch", stats["num_running"]),
            "pagedserve_num_requests_waiting": ("Sequences waiting to be scheduled", stats["num_waiting"]),
            "pagedserve_kv_blocks_total": ("KV pages in the pool", stats["num_blocks"]),
            "pagedserve_kv_blocks_in_use": ("KV pages with ref_count > 0", stats["num_blocks"] - stats["num_free_blocks"]),
            "pagedserve_kv_blocks_free": ("KV pages with ref_count 0, cached or not", stats["num_free_blocks"]),
            "pagedserve_kv_blocks_cached": ("KV pages holding a hashed prefix block", stats["num_cached_blocks"]),
            "pagedserve_kv_tokens": ("Token slots holding K/V of live sequences", stats["num_kv_tokens"]),
        }
        if "num_workers" in stats:  # a front door behind Dynamo: the gauges above are summed over these
            gauges["pagedserve_workers"] = ("Live workers (behind Dynamo) the stats are summed over", stats["num_workers"])
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "pagedserve_prefix_cache_queries": ("Prompt tokens looked up in the prefix cache", stats["prefix_cache_queries"]),
            "pagedserve_prefix_cache_hits": ("Prompt tokens found in the prefix cache", stats["prefix_cache_hits"]),
            "pagedserve_num_preemptions": ("Sequences preempted for recompute", stats["num_preemptions"]),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
        yield from self._tenant_metrics(stats.get("tenants", {}))
        yield from self._vllm_metrics(stats)

    @staticmethod
    def _tenant_metrics(tenants: dict[str, dict]):
        """Per tenant: service counted (fair scheduling's counters, and tokens), and its queue."""
        for name, doc, key, family in (
            ("pagedserve_tenant_virtual_tokens", "The tenant's virtual token counter (weighted service / its weight).",
             "virtual_tokens", GaugeMetricFamily),
            ("pagedserve_tenant_served_prompt_tokens", "Prompt tokens computed for the tenant (cache hits excluded).",
             "served_input_tokens", CounterMetricFamily),
            ("pagedserve_tenant_served_output_tokens", "Tokens generated for the tenant.", "served_output_tokens",
             CounterMetricFamily),
            ("pagedserve_tenant_requests_waiting", "The tenant's sequences waiting to be scheduled.", "num_waiting",
             GaugeMetricFamily),
            ("pagedserve_tenant_requests_running", "The tenant's sequences in the running batch.", "num_running",
             GaugeMetricFamily),
        ):
            metric = family(name, doc, labels=["tenant"])
            for tenant, row in sorted(tenants.items()):
                metric.add_metric([tenant], row[key])
            yield metric

    def _vllm_metrics(self, stats: dict):
        labels = {"model_name": self.model_name, "engine": "0"}
        total = stats["num_blocks"]
        usage = (total - stats["num_free_blocks"]) / total if total else 0.0
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests in the running batch (sequences).", stats["num_running"]),
            ("vllm:num_requests_waiting", "Requests waiting for a place in the batch (sequences).", stats["num_waiting"]),
            ("vllm:kv_cache_usage_perc", "Fraction of KV pages in use (0 to 1).", usage),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=list(labels))
            gauge.add_metric(list(labels.values()), value)
            yield gauge
        config = {"block_size": str(stats["block_size"]), "num_gpu_blocks": str(total),
                  "enable_prefix_caching": "True", "cache_dtype": "auto"}
        info = GaugeMetricFamily("vllm:cache_config_info", "The KV cache layout, as labels (value 1).", labels=list(config))
        info.add_metric(list(config.values()), 1.0)
        yield info
        for name, doc, key in (
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             "prefix_cache_queries"),
            ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
            ("vllm:spec_decode_num_drafts", "Sequence-steps that verified drafts.", "spec_decode_num_drafts"),
            ("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", "spec_decode_num_draft_tokens"),
            ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", "spec_decode_num_accepted_tokens"),
        ):
            counter = CounterMetricFamily(name, doc, labels=list(labels))
            counter.add_metric(list(labels.values()), stats.get(key, 0))
            yield counter
        per_position = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                           "Draft tokens accepted, by their position in the draft (0 first).",
                                           labels=[*labels, "position"])
        for position, count in enumerate(stats.get("spec_decode_accepted_per_position", [])):
            per_position.add_metric([*labels.values(), str(position)], count)
        yield per_position


TENANT_SERIES = b"pagedserve_tenant_"


def _names_a_tenant(line: bytes) -> bool:
    """A sample, HELP or TYPE line of a per-tenant family."""
    return line.startswith(TENANT_SERIES) or line.startswith(b"# HELP " + TENANT_SERIES) \
        or line.startswith(b"# TYPE " + TENANT_SERIES)


class ServiceMetrics:
    """Request-level counters and latency histograms, plus the engine collector."""

    def __init__(self, get_stats: Callable[[], dict], model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(get_stats, model_name))
        self.prompt_tokens = Counter("pagedserve_prompt_tokens", "Prompt tokens of finished requests", registry=self.registry)
        self.cached_tokens = Counter("pagedserve_cached_prompt_tokens", "Prompt tokens served from cached pages", registry=self.registry)
        self.generation_tokens = Counter("pagedserve_generation_tokens", "Tokens generated and sent", registry=self.registry)
        self.requests = Counter("pagedserve_request_success", "Finished requests by finish reason",
                                ["finished_reason"], registry=self.registry)
        self.ttft = Histogram("pagedserve_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
                              registry=self.registry)
        self.itl = Histogram("pagedserve_inter_token_latency_seconds", "Time between token deliveries",
                             buckets=ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("pagedserve_e2e_request_latency_seconds", "Request latency, arrival to end",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.api_requests = Counter("pagedserve_api_requests", "Finished API requests by API", ["api"],
                                    registry=self.registry)

    def count_api(self, api: str) -> None:
        """One finished request of `api` (chat.completions, completions, messages, responses)."""
        self.api_requests.labels(api=api).inc()

    @property
    def requests_by_api(self) -> dict[str, int]:
        """The counter's values by API (the dashboard's panel)."""
        return {sample.labels["api"]: int(sample.value) for metric in self.api_requests.collect()
                for sample in metric.samples if sample.name.endswith("_total")}

    def observe(self, stream: RequestStream, finish_reason: str, elapsed: float) -> None:
        self.prompt_tokens.inc(stream.num_prompt_tokens)
        self.cached_tokens.inc(stream.num_cached_tokens)
        self.generation_tokens.inc(stream.num_output_tokens)
        self.requests.labels(finished_reason=finish_reason).inc()
        if stream.ttft is not None:
            self.ttft.observe(stream.ttft)
        for gap in stream.inter_token_latencies:
            self.itl.observe(gap)
        self.e2e.observe(elapsed)

    def render(self, with_tenants: bool = True) -> bytes:
        """The Prometheus page; without the per-tenant series (pagedserve_tenant_*) for an open /metrics."""
        page = generate_latest(self.registry)
        if with_tenants:
            return page
        return b"".join(line for line in page.splitlines(keepends=True) if not _names_a_tenant(line))
