"""The figures of one open-loop run (vLLM 0.32: ``BenchmarkMetrics`` and ``calculate_metrics`` in
``vllm/benchmarks/serve.py``).

Per successful request: TTFT (send to first chunk), TPOT (``(latency - ttft) / (output_tokens - 1)``, the mean
time per output token after the first; 0 for a one-token request, as in vLLM), end-to-end latency (E2EL, send to
the last chunk carrying a choice, as vLLM times it); the ITLs of all requests are pooled. Percentiles interpolate linearly (``numpy.percentile``).
Throughput divides by the run's duration (first send to last response). Goodput (DistServe, Zhong et al. 2024,
section 2) is the number of requests per second that met every service-level objective given: a request is good
when each of its measured TTFT / TPOT / E2EL is at most the SLO of that name.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence

from minivllm.bench.metrics import percentile
from minivllm.bench.serve.request_func import RequestFuncOutput

SLO_NAMES = ("ttft", "tpot", "e2el")
PERCENTILES = (50.0, 90.0, 99.0)


def parse_goodput(pairs: Sequence[str]) -> Dict[str, float]:
    """``["ttft:500", "tpot:100"]`` -> ``{"ttft": 500.0, "tpot": 100.0}`` (milliseconds, vLLM's ``--goodput``).

    Raises:
        ValueError: for a pair that is not ``name:ms``, a name outside ``ttft``, ``tpot``, ``e2el``, or a value <= 0.
    """
    slos: Dict[str, float] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        if not sep or name not in SLO_NAMES:
            raise ValueError(f"--goodput takes name:milliseconds pairs with name in {','.join(SLO_NAMES)}, got {pair!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {name}: the SLO must be a number of milliseconds, got {value!r}") from None
        if not ms > 0:
            raise ValueError(f"--goodput {name}: the SLO must be > 0 ms, got {value!r}")
        slos[name] = ms
    return slos


@dataclass
class BenchmarkMetrics:
    """One run's figures. Times in milliseconds, throughputs per second.

    Attributes:
        completed / failed: requests that succeeded / failed.
        total_input / total_output: prompt and output tokens of the completed requests.
        duration_s: from the first send to the last response.
        request_throughput, output_throughput, total_token_throughput: completed requests, output tokens, prompt
            plus output tokens per second of ``duration_s``.
        request_goodput: completed requests meeting every SLO in ``goodput_slos_ms``, per second (``None``
            without SLOs).
        good_completed: how many requests met them.
        ttft_ms, tpot_ms, itl_ms, e2el_ms: ``{"mean", "p50", "p90", "p99", ...}`` (one key per percentile asked
            for; ``None`` values when there is no sample).
        goodput_slos_ms: the SLOs (``{"ttft": 500.0}``).
    """

    completed: int
    failed: int
    total_input: int
    total_output: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: Optional[float]
    good_completed: int
    ttft_ms: Dict[str, Optional[float]]
    tpot_ms: Dict[str, Optional[float]]
    itl_ms: Dict[str, Optional[float]]
    e2el_ms: Dict[str, Optional[float]]
    goodput_slos_ms: Dict[str, float] = field(default_factory=dict)

    def to_json(self) -> Dict:
        return asdict(self)


def _summary(values_s: List[float], percentiles: Sequence[float]) -> Dict[str, Optional[float]]:
    ms = [v * 1000.0 for v in values_s]
    out: Dict[str, Optional[float]] = {"mean": sum(ms) / len(ms) if ms else None}
    for q in percentiles:
        out[f"p{q:g}"] = percentile(ms, q)
    return out


def request_tpot(o: RequestFuncOutput) -> float:
    """Mean seconds per output token after the first; 0.0 for a request of at most one token (vLLM's rule)."""
    return (o.latency - o.ttft) / (o.output_tokens - 1) if o.output_tokens > 1 else 0.0


def calculate_metrics(outputs: Sequence[RequestFuncOutput], duration_s: float,
                      goodput_slos_ms: Optional[Dict[str, float]] = None,
                      percentiles: Sequence[float] = PERCENTILES) -> BenchmarkMetrics:
    """The figures of a run from its requests' outputs.

    Args:
        outputs: one per request sent (failed ones count in ``failed`` only).
        duration_s: the run's wall time, seconds (> 0).
        goodput_slos_ms: SLOs in milliseconds by name (``ttft``, ``tpot``, ``e2el``); ``None`` or empty: no goodput.
        percentiles: which percentiles to report (0..100).

    Raises:
        ValueError: for ``duration_s <= 0`` or an unknown SLO name.
    """
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    slos = dict(goodput_slos_ms or {})
    unknown = set(slos) - set(SLO_NAMES)
    if unknown:
        raise ValueError(f"goodput_slos_ms: unknown SLO name(s) {sorted(unknown)}; known: {', '.join(SLO_NAMES)}")
    ok = [o for o in outputs if o.success]
    ttfts = [o.ttft for o in ok]
    tpots = [request_tpot(o) for o in ok if o.output_tokens > 1]
    e2els = [o.latency for o in ok]
    itls = [x for o in ok for x in o.itl]
    good = 0
    for o in ok:
        measured = {"ttft": o.ttft, "tpot": request_tpot(o), "e2el": o.latency}
        good += all(measured[name] * 1000.0 <= slo for name, slo in slos.items())
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_tokens for o in ok)
    return BenchmarkMetrics(
        completed=len(ok), failed=len(outputs) - len(ok), total_input=total_in, total_output=total_out,
        duration_s=duration_s, request_throughput=len(ok) / duration_s, output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        request_goodput=good / duration_s if slos else None, good_completed=good if slos else 0,
        ttft_ms=_summary(ttfts, percentiles), tpot_ms=_summary(tpots, percentiles),
        itl_ms=_summary(itls, percentiles), e2el_ms=_summary(e2els, percentiles), goodput_slos_ms=slos,
    )
