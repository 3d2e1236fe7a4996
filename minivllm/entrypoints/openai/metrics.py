"""``/metrics``: Prometheus text format with vLLM's metric names (vLLM: ``vllm/v1/metrics/loggers.py``,
``PrometheusStatLogger``).

Served, with labels ``model_name`` and ``engine`` as in vLLM:

* ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` (gauges), ``vllm:kv_cache_usage_perc`` (gauge,
  a fraction: 1 means 100 percent, vLLM's convention) and ``vllm:num_preemptions_total`` (counter), read from the
  engine thread's last ``EngineStats`` snapshot when scraped;
* ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds`` and
  ``vllm:e2e_request_latency_seconds`` (histograms), ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``
  and ``vllm:request_success_total`` (counters; the last labelled ``finished_reason``), observed by the serving
  layer as each request's outputs arrive.

The engine thread takes its snapshot after a step, so after aborts that leave it idle the snapshot still counts
the aborted requests; the gauges therefore read 0 whenever the engine has no unfinished request or has died.

Where minivllm differs from vLLM: the latencies are measured in the API server from the moment it accepted the
request (vLLM's engine core stamps them); the histogram buckets are minivllm's, spanning a CPU's slower steps; each
server has its own ``CollectorRegistry`` so that several can run in one process (the tests do).
"""

from __future__ import annotations

from typing import Iterable, List, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from minivllm.engine.async_llm import AsyncLLM
from minivllm.metrics.stats import RequestStateStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0]
_E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0]  # vLLM's
_ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                10.0, 20.0]


class _EngineStatsCollector(Collector):
    def __init__(self, async_llm: AsyncLLM, labels: List[str]) -> None:
        self.async_llm, self.labels = async_llm, labels

    def collect(self) -> Iterable[Metric]:
        stats, names = self.async_llm.stats, ["model_name", "engine"]
        running, waiting, usage = stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage
        # Read from the scraping thread: a stale "no" only delays the zeros to the next scrape.
        if self.async_llm.errored or not self.async_llm.engine.has_unfinished_requests():
            running, waiting, usage = 0, 0, 0.0
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage),
        ):
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(self.labels, float(value))
            yield g
        c = CounterMetricFamily("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                                labels=names)
        c.add_metric(self.labels, float(stats.num_preemptions))
        yield c


class ServerMetrics:
    """The server's Prometheus registry.

    Args:
        async_llm: the engine whose ``stats`` the gauges and the counter report.
        model_name: the served model name (the ``model_name`` label).
    """

    def __init__(self, async_llm: AsyncLLM, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = [model_name, "0"]
        self.registry.register(_EngineStatsCollector(async_llm, labels))
        self.time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            ["model_name", "engine"], buckets=_TTFT_BUCKETS, registry=self.registry).labels(*labels)
        self.inter_token_latency = Histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            ["model_name", "engine"], buckets=_ITL_BUCKETS, registry=self.registry).labels(*labels)
        self.e2e_request_latency = Histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            ["model_name", "engine"], buckets=_E2E_BUCKETS, registry=self.registry).labels(*labels)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                     ["model_name", "engine"], registry=self.registry).labels(*labels)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         ["model_name", "engine"], registry=self.registry).labels(*labels)
        self.request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                       ["model_name", "engine", "finished_reason"], registry=self.registry)
        self.labels = labels

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class RequestTimer:
    """Observes one request's TTFT and inter-token latencies (seconds, ``time.perf_counter``).

    Time to first token comes from the engine's own ``RequestOutput.metrics`` when the output carries it (vLLM
    measures it in the engine too), so it is right for a whole response, whose only output is the final one. The
    inter-token latencies are the gaps between streamed outputs; an output that brings several tokens at once (a
    whole response) adds the engine's mean gap between its first and last token, once per gap (where minivllm
    differs from vLLM, which observes each step's gap in the engine).
    """

    def __init__(self, metrics: Optional[ServerMetrics], start: float) -> None:
        self.metrics, self.last, self.start = metrics, start, start
        self.first = True

    def on_finished(self, now: float, num_prompt_tokens: int, finish_reason: Optional[str]) -> None:
        """Called once with the finished output (aborts count too, as in vLLM: ``finished_reason="abort"``)."""
        if self.metrics is None:
            return
        self.metrics.e2e_request_latency.observe(now - self.start)
        self.metrics.prompt_tokens.inc(num_prompt_tokens)
        self.metrics.request_success.labels(*self.metrics.labels, str(finish_reason)).inc()

    def on_tokens(self, now: float, num_new_tokens: int, stats: Optional[RequestStateStats] = None) -> None:
        """Called for each output; only outputs carrying tokens count. ``stats``: the output's engine-side
        ``RequestOutput.metrics``."""
        if self.metrics is None or num_new_tokens == 0:
            return
        self.metrics.generation_tokens.inc(num_new_tokens)
        gap = now - self.last
        if self.first:
            ttft = stats.first_token_latency if stats is not None else None
            self.metrics.time_to_first_token.observe(gap if ttft is None else ttft)
            self.first = False
            if num_new_tokens > 1 and stats is not None and stats.first_token_ts is not None \
                    and stats.last_token_ts is not None:
                mean_gap = (stats.last_token_ts - stats.first_token_ts) / (num_new_tokens - 1)
                for _ in range(num_new_tokens - 1):
                    self.metrics.inter_token_latency.observe(mean_gap)
        else:
            for _ in range(num_new_tokens):
                self.metrics.inter_token_latency.observe(gap / num_new_tokens)
        self.last = now
