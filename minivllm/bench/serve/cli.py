"""``python -m minivllm bench serve``: the same open-loop load against one or more OpenAI-compatible servers.

Targets: ``--base-url`` (any server already running), minivllm's own server started here (unless ``--no-minivllm``) and,
with ``--vllm-python``, ``vllm serve`` started here from vLLM's CPU build on the same weights. The requests are the
benchmark's seeded random prompts (``minivllm.bench.workload.random_workload``: prompt token ids, greedy,
``ignore_eos``), sent at the times ``arrivals.arrival_times`` draws for each ``--request-rate``; every target gets the
same requests at the same times. Runs are interleaved (repeat, then rate, then target) so that a change in the machine's
load during the run affects every target alike, and with two targets or more each run first waits (``--settle``) until
the machine is quiet, so that the last run's server, still finishing, does not share the CPUs with the next one's.
Prints one line per run and a summary with the spread over ``--repeats``; writes every run to JSON and a
latency-against-rate plot next to it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shlex
import statistics
import sys
import time
from dataclasses import asdict
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from minivllm.i18n import TABLE_LABEL, L_, _, pgettext, rjust

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEFAULT_VOCAB, TINY_VOCAB = 49152, 512
#: The machine counts as quiet for the next run when its CPUs were busy less than QUIET_CPUS over QUIET_WINDOW_S.
QUIET_CPUS, QUIET_WINDOW_S = 0.25, 0.5


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minivllm bench serve", description=__doc__.split("\n")[0])
    t = p.add_argument_group("targets")
    t.add_argument("--base-url", action="append", default=[], metavar="URL",
                   help="a running OpenAI-compatible server, e.g. http://127.0.0.1:8000 (repeatable)")
    t.add_argument("--served-model-name", default=None,
                   help="model name sent to --base-url servers (default: the first of their /v1/models)")
    t.add_argument("--api-key", default=None, help="bearer token for --base-url servers")
    t.add_argument("--no-minivllm", action="store_true", help="do not start minivllm's server")
    t.add_argument("--model", default=None, help="minivllm's model: 'tiny', a .gguf or a HF folder (default SmolLM2)")
    t.add_argument("--vllm-python", default=None,
                   help="python of the vLLM CPU venv: start 'vllm serve' on the same SmolLM2 weights too")
    t.add_argument("--vllm-args", default="", metavar="ARGS",
                   help="extra 'vllm serve' arguments as one string, given with '=': --vllm-args=--enforce-eager (no torch.compile at start)")
    t.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    t.add_argument("--threads", type=int, default=None, help="CPU threads of each started server (default: theirs)")
    t.add_argument("--startup-timeout", type=float, default=600.0, help="seconds a started server may take")
    w = p.add_argument_group("load")
    w.add_argument("--request-rate", default=["1", "2", "4"], nargs="+", metavar="RATE",
                   help="requests per second, one run each ('inf': all at once)")
    w.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson arrivals)")
    w.add_argument("--num-prompts", type=int, default=32)
    w.add_argument("--prompt-len", type=int, nargs=2, default=[100, 300], metavar=("LOW", "HIGH"))
    w.add_argument("--output-len", type=int, nargs=2, default=[32, 128], metavar=("LOW", "HIGH"))
    w.add_argument("--vocab-size", type=int, default=None, help=f"prompt ids below it (default {DEFAULT_VOCAB}; "
                   f"{TINY_VOCAB} for --model tiny)")
    w.add_argument("--seed", type=int, default=0, help="seed of the prompts and of the arrival times")
    w.add_argument("--repeats", type=int, default=1, help="runs per rate and target")
    w.add_argument("--warmup", type=int, default=2, help="short requests sent to each target before timing")
    w.add_argument("--settle", type=float, default=10.0, metavar="SECONDS",
                   help="with two targets or more: before each run, wait at most this long until the CPUs were "
                   f"busy less than {QUIET_CPUS} CPU over {QUIET_WINDOW_S} s (0: do not wait)")
    w.add_argument("--goodput", nargs="+", default=["ttft:2000", "tpot:200"], metavar="NAME:MS",
                   help="SLOs in ms (ttft, tpot, e2el) that a request must meet to count in goodput")
    o = p.add_argument_group("output")
    o.add_argument("--json", default=None, help="results file (default bench-results/bench-serve-<time>.json)")
    o.add_argument("--plot", default=None, help="latency-vs-rate PNG (default: the JSON path with .png)")
    o.add_argument("--log-dir", default=None, help="started servers' logs (default: the JSON's folder)")
    return p


def parse_rates(values: Sequence[str]) -> List[float]:
    """``["1", "2.5", "inf"]`` -> ``[1.0, 2.5, inf]``. Raises ``ValueError`` for a value that is not > 0."""
    rates = []
    for v in values:
        try:
            r = float(v)
        except ValueError:
            raise ValueError(f"--request-rate takes numbers > 0 or 'inf', got {v!r}") from None
        if not r > 0:
            raise ValueError(f"--request-rate takes numbers > 0 or 'inf', got {v!r}")
        rates.append(r)
    return rates


def check_args(a) -> None:
    """Validate everything before any server starts. Raises ``ValueError`` naming the option and its limit."""
    from minivllm.bench.serve.metrics import parse_goodput
    from minivllm.bench.workload import _check_range

    a.rates = parse_rates(a.request_rate)
    a.slos = parse_goodput(a.goodput)
    _check_range("--prompt-len", a.prompt_len)
    _check_range("--output-len", a.output_len)
    for name in ("num_prompts", "repeats"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {a.warmup}")
    if not (a.settle >= 0 and math.isfinite(a.settle)):
        raise ValueError(f"--settle must be a finite number >= 0, got {a.settle}")
    if not (a.burstiness > 0 and math.isfinite(a.burstiness)):
        raise ValueError(f"--burstiness must be a finite number > 0, got {a.burstiness}")
    if a.threads is not None and a.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {a.threads}")
    if a.no_minivllm and not a.base_url and not a.vllm_python:
        raise ValueError("no target: give --base-url or --vllm-python, or drop --no-minivllm")
    if a.vllm_python and not os.path.isfile(a.vllm_python):
        raise ValueError(f"--vllm-python: no such file {a.vllm_python!r} (./course.sh vllm-check installs the venv)")
    if a.vocab_size is None:
        a.vocab_size = TINY_VOCAB if a.model == "tiny" else DEFAULT_VOCAB


# ---- one run ---------------------------------------------------------------------------------------------------
def wait_until_quiet(max_s: float, busy_seconds: Optional[Callable[[], float]] = None,
                     clock: Callable[[], float] = time.monotonic,
                     sleep: Callable[[float], None] = time.sleep) -> Tuple[float, Optional[bool]]:
    """Wait until this process's CPUs were busy less than ``QUIET_CPUS`` over a window of ``QUIET_WINDOW_S``
    seconds (a shorter last window when ``max_s`` ends first), at most ``max_s`` seconds; returns ``(seconds waited,
    whether the CPUs were quiet)``, the second ``None`` when nothing was checked.

    Why: a server does not stop using the CPUs with its last response. After vLLM 0.32's CPU server answered a
    burst of 8 requests, a two-core AMD EPYC's CPUs were busy 0.41 CPUs on average over the next 2.5 s, then
    0.00-0.02; the run after it, another target's, would meet that as contention.
    ``busy_seconds``: CPU seconds not idle on the CPUs this process may run on, where the servers it started run
    too (default ``/proc/stat``); without ``/proc/stat`` this returns ``(0.0, None)`` at once, as for ``max_s <= 0``.
    """
    if max_s <= 0:
        return 0.0, None
    if busy_seconds is None:
        if not os.path.exists("/proc/stat"):
            return 0.0, None
        from minivllm.worker.cpu_threads import proc_stat_busy_seconds, process_cpus

        cpus = process_cpus()
        busy_seconds = lambda: proc_stat_busy_seconds(cpus)  # noqa: E731
    t0 = clock()
    while True:
        b0, w0 = busy_seconds(), clock()
        left = max_s - (w0 - t0)
        if left < 0.01:  # a window shorter than a clock tick of /proc/stat could read anything
            return w0 - t0, False
        sleep(min(QUIET_WINDOW_S, left))
        b1, w1 = busy_seconds(), clock()
        if (b1 - b0) < QUIET_CPUS * (w1 - w0):
            return w1 - t0, True


def _client():
    import httpx

    return httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


async def run_load(base_url: str, model: str, prompts: Sequence[List[int]], output_lens: Sequence[int],
                   arrivals: Sequence[float], api_key: Optional[str] = None):
    """Send request ``i`` at ``arrivals[i]`` seconds after the start, without waiting for earlier ones (open loop).

    Returns ``(outputs, duration_s)``: one ``RequestFuncOutput`` per request, and the time from the first send to
    the last response.
    """
    from minivllm.bench.serve.request_func import RequestFuncInput, async_request_openai_completions

    url = base_url.rstrip("/") + "/v1/completions"
    async with _client() as client:
        t0 = time.perf_counter()
        tasks = []
        for prompt, n, at in zip(prompts, output_lens, arrivals):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            inp = RequestFuncInput(list(prompt), int(n), model, url, api_key)
            tasks.append(asyncio.ensure_future(async_request_openai_completions(inp, client)))
        outputs = await asyncio.gather(*tasks)
        return list(outputs), time.perf_counter() - t0


def scrape_preemptions(base_url: str) -> Optional[float]:
    """``vllm:num_preemptions_total`` from ``/metrics`` (both servers export it); ``None`` if absent."""
    import httpx

    try:
        text = httpx.get(base_url.rstrip("/") + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    values = [float(m.group(1)) for m in re.finditer(r"^vllm:num_preemptions_total(?:\{[^}]*\})? (\S+)$", text, re.M)]
    return sum(values) if values else None


def served_model(base_url: str, api_key: Optional[str]) -> str:
    """The first model id of ``GET /v1/models``. Raises ``RuntimeError`` if there is none."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return data[0]["id"]


# ---- the sweep -------------------------------------------------------------------------------------------------
def _start_servers(a, log_dir: str, skipped: Dict[str, str]) -> Tuple[list, List[dict]]:
    """Start minivllm's server and ``vllm serve`` as asked. A ``vllm serve`` that fails to start is recorded in
    ``skipped`` (the others still run) unless it was the only target."""
    from minivllm.bench.serve.servers import free_port, minivllm_server, vllm_server

    started, targets = [], []
    try:
        if not a.no_minivllm:
            s = minivllm_server(a.model, free_port(), a.dtype, "minivllm-model", a.threads,
                                log_path=os.path.join(log_dir, "server-minivllm.log"))
            started.append(s)
            print(f"[bench serve] starting minivllm: {' '.join(s.cmd)}", flush=True)
            s.start(a.startup_timeout)
            print(f"[bench serve] minivllm healthy after {s.startup_s:.1f} s", flush=True)
        if a.vllm_python:
            from minivllm.bench.vllm_check.model_folder import ensure_model_folder

            folder = ensure_model_folder() if a.model in (None, "tiny") or not os.path.isdir(a.model) else a.model
            if a.model == "tiny":
                raise ValueError("--vllm-python needs a real model: vLLM cannot load the tiny random model")
            s = vllm_server(a.vllm_python, folder, free_port(), a.dtype, "vllm-model", a.threads,
                            extra_args=shlex.split(a.vllm_args), log_path=os.path.join(log_dir, "server-vllm.log"))
            print(f"[bench serve] starting vllm serve {' '.join(s.cmd[4:])} (log {s.log_path})", flush=True)
            try:
                s.start(a.startup_timeout)
                started.append(s)
                print(f"[bench serve] vllm healthy after {s.startup_s:.1f} s", flush=True)
            except RuntimeError as e:  # an optional peer that cannot start must not cost the other results
                if not started and not a.base_url:
                    raise
                skipped["vllm"] = str(e)
                print(f"[bench serve] skipping vllm: {str(e).splitlines()[0]} (log {s.log_path})", flush=True)
    except Exception:
        for s in started:
            s.stop()
        raise
    # Both servers take VLLM_API_KEY from the environment they inherit as their key: send it to them.
    key = os.environ.get("VLLM_API_KEY") or None
    for s in started:
        targets.append({"name": s.name, "base_url": s.base_url, "model": s.served_model_name, "api_key": key,
                        "startup_s": s.startup_s})
    return started, targets


def _fmt(x: Optional[float], nd: int = 0) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def run_line(r: dict) -> str:
    m = r["metrics"]
    good = "" if m["request_goodput"] is None else f" goodput {m['request_goodput']:.2f} req/s ({m['good_completed']}/{m['completed']})"
    return (f"{r['target']:>9} rate {r['request_rate']:>5g} #{r['repeat'] + 1}: {m['completed']} ok {m['failed']} failed, "
            f"{m['request_throughput']:.2f} req/s, {m['output_throughput']:.0f} out tok/s, TTFT p50/p90/p99 "
            f"{_fmt(m['ttft_ms']['p50'])}/{_fmt(m['ttft_ms']['p90'])}/{_fmt(m['ttft_ms']['p99'])} ms, ITL p50/p99 "
            f"{_fmt(m['itl_ms']['p50'])}/{_fmt(m['itl_ms']['p99'])} ms, TPOT p50 {_fmt(m['tpot_ms']['p50'])} ms, "
            f"E2EL p50/p99 {_fmt(m['e2el_ms']['p50'])}/{_fmt(m['e2el_ms']['p99'])} ms, "
            f"preemptions {_fmt(r.get('preemptions'))}{good}")


def summarize(runs: List[dict]) -> List[dict]:
    """Per (target, rate): median, min and max over repeats of output tok/s, p99 TTFT, p50 ITL, p99 E2EL, goodput."""
    keys = {"output_tok_s": lambda m: m["output_throughput"], "ttft_p99_ms": lambda m: m["ttft_ms"]["p99"],
            "itl_p50_ms": lambda m: m["itl_ms"]["p50"], "e2el_p99_ms": lambda m: m["e2el_ms"]["p99"],
            "goodput_req_s": lambda m: m["request_goodput"]}
    groups: Dict[Tuple[str, float], List[dict]] = {}
    for r in runs:
        groups.setdefault((r["target"], r["request_rate"]), []).append(r["metrics"])
    out = []
    for (target, rate), ms in groups.items():
        row: Dict = {"target": target, "request_rate": rate, "runs": len(ms)}
        for k, f in keys.items():
            vals = [f(m) for m in ms if f(m) is not None]
            row[k] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)} if vals else None
        out.append(row)
    return out


def format_summary(rows: List[dict]) -> str:
    def cell(v, nd=0):
        return "-" if v is None else f"{v['median']:.{nd}f} ({v['min']:.{nd}f}-{v['max']:.{nd}f})"

    header = [(L_("target"), 9), (L_("rate"), 5), (L_("output tok/s"), 20), (L_("p99 TTFT ms"), 22),
              (L_("p50 ITL ms"), 18), (L_("p99 E2EL ms"), 22), (L_("goodput req/s"), 18)]
    lines = [" ".join(rjust(pgettext(TABLE_LABEL, name), width) for name, width in header)]
    for r in rows:
        lines.append(f"{r['target']:>9} {r['request_rate']:>5g} {cell(r['output_tok_s']):>20} "
                     f"{cell(r['ttft_p99_ms']):>22} {cell(r['itl_p50_ms']):>18} {cell(r['e2el_p99_ms']):>22} "
                     f"{cell(r['goodput_req_s'], 2):>18}")
    return "\n".join(lines) + "\n" + _("(median over repeats, min-max in brackets)")


def run_benchmark(a) -> Dict:
    """Start the servers asked for, run the sweep, stop them. Returns the JSON record (``runs``, ``summary``, ...)."""
    from minivllm.bench.serve.arrivals import arrival_times
    from minivllm.bench.serve.metrics import calculate_metrics
    from minivllm.bench.workload import random_workload

    wl = random_workload(a.num_prompts, a.prompt_len, a.output_len, a.vocab_size, a.seed)
    log_dir = a.log_dir or os.path.dirname(os.path.abspath(a.json))
    os.makedirs(log_dir, exist_ok=True)
    targets = [{"name": f"url{i}" if len(a.base_url) > 1 else "url", "base_url": u,
                "model": a.served_model_name or served_model(u, a.api_key), "api_key": a.api_key}
               for i, u in enumerate(a.base_url)]
    skipped: Dict[str, str] = {}
    started, own = _start_servers(a, log_dir, skipped)
    targets += own
    runs: List[dict] = []
    try:
        for t in targets:  # warm-up: kernels, allocators, first-request paths
            if a.warmup:
                n = min(a.warmup, wl.num_requests)
                outs, _elapsed = asyncio.run(run_load(t["base_url"], t["model"], wl.prompts[:n], [4] * n, [0.0] * n,
                                               t["api_key"]))
                bad = [o.error for o in outs if not o.success]
                if bad:
                    raise RuntimeError(f"{t['name']}: warm-up request failed: {bad[0]}")
        for rep in range(a.repeats):
            for rate in a.rates:
                arrivals = arrival_times(wl.num_requests, rate, a.burstiness, a.seed + rep)
                for t in targets:
                    settled, quiet = wait_until_quiet(a.settle) if len(targets) > 1 else (0.0, None)
                    if quiet is False:
                        print(f"    the CPUs were still busy after --settle {a.settle:g} s: {t['name']}'s run starts "
                              "anyway", flush=True)
                    before = scrape_preemptions(t["base_url"])
                    load = list(os.getloadavg())
                    outs, dur = asyncio.run(run_load(t["base_url"], t["model"], wl.prompts, wl.max_tokens, arrivals,
                                                     t["api_key"]))
                    after = scrape_preemptions(t["base_url"])
                    m = calculate_metrics(outs, dur, a.slos)
                    r = {"target": t["name"], "request_rate": rate, "repeat": rep, "metrics": m.to_json(),
                         "preemptions": None if before is None or after is None else after - before,
                         "settle_s": round(settled, 2), "settled_quiet": quiet,
                         "loadavg_before": load, "loadavg_after": list(os.getloadavg()),
                         "errors": sorted({o.error for o in outs if not o.success})[:5]}
                    runs.append(r)
                    print(run_line(r), flush=True)
                    for e in r["errors"]:
                        print(f"    error: {e}", flush=True)
    finally:
        for s in started:
            s.stop()
    args = {k: v for k, v in vars(a).items() if k not in ("api_key",)}
    return {"args": args, "workload": wl.summary(), "targets": [{k: v for k, v in t.items() if k != "api_key"}
                                                                 for t in targets],
            "runs": runs, "summary": summarize(runs), "skipped": skipped, "cpu_count": os.cpu_count(),
            "env": recorded_env(os.environ)}


def recorded_env(environ: Dict[str, str]) -> Dict[str, str]:
    """The ``MINIVLLM_*``, ``VLLM_*`` and ``OMP_*`` variables the started servers inherit
    (``MINIVLLM_CPU_KERNELS_FP32=1`` sends minivllm's float32 through its kernels), for the results JSON. Secrets
    (``VLLM_API_KEY``, which ``vllm serve`` takes as its API key, or any name with ``KEY``, ``TOKEN``, ``SECRET``
    or ``PASSWORD``) are left out, as ``--api-key`` is."""
    secret = re.compile(r"KEY|TOKEN|SECRET|PASSWORD", re.IGNORECASE)
    return {k: v for k, v in sorted(environ.items())
            if k.startswith(("MINIVLLM_", "VLLM_", "OMP_")) and not secret.search(k)}


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point. Returns 0 when every request of every run succeeded, 1 if some failed, 2 for bad arguments."""
    parser = build_parser()
    a = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        check_args(a)
    except ValueError as e:
        parser.print_usage(sys.stderr)
        print(f"error: {e}", file=sys.stderr)
        return 2
    a.json = a.json or os.path.join("bench-results", time.strftime("bench-serve-%Y%m%d-%H%M%S.json"))
    a.plot = a.plot or os.path.splitext(a.json)[0] + ".png"
    out = run_benchmark(a)
    print()
    print(format_summary(out["summary"]))
    for peer, why in out["skipped"].items():
        print(_("(skipped {peer}: {why})").format(peer=peer, why=why.splitlines()[0]))
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1, default=lambda x: asdict(x) if hasattr(x, "__dataclass_fields__") else str(x))
    from minivllm.bench.serve.plot import plot_latency_vs_rate

    plot_latency_vs_rate(out["summary"], a.plot)
    print(_("results written to {json}, plot to {plot}").format(json=a.json, plot=a.plot))
    return 0 if all(r["metrics"]["failed"] == 0 for r in out["runs"]) else 1
