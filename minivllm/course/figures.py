"""``python -m minivllm figures``: regenerate every figure in ``images/`` from real engine runs.

Figures are a registry ``file name -> function(path)``: each function runs the engine (the tiny random-weight
model where only scheduling mechanics matter), draws, and writes one file at ``path``. To add a figure::

    from minivllm.course.figures import register

    @register("my_figure.png")
    def my_figure(path):
        ...                                   # run the engine, draw, fig.savefig(path)

Registration happens on import: modules that define figures are listed in ``FIGURE_MODULES`` and imported by
``main``. Nothing in a figure is drawn by hand; every number comes from the run, or, for the one figure of a
measurement that needs vLLM's own server (``bench_serve_vs_vllm.png``), from that hand-run measurement's record
(``minivllm/bench/serve/measurement_float32.json``), so that the Chinese copy is drawn from the same numbers.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

from minivllm.i18n import LANGUAGES, _, get_language, set_language

FIGURES: Dict[str, Callable[[Path], None]] = {}
"""``file name -> function(path)`` for every registered figure."""

FIGURE_MODULES: List[str] = ["minivllm.course.figures", "minivllm.course.diagrams"]
"""Modules imported by ``main`` so that their ``@register`` decorators run (add yours here)."""

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "images"
ZH_SUBDIR = "zh-CN"
"""``--lang zh_CN`` writes to ``images/zh-CN/``: the Chinese edition's build (``minivllm.course.edition``) shows
``images/zh-CN/<name>`` instead of ``images/<name>`` where that file exists."""
_DPI = 100


def register(name: str):
    """Decorator: register ``fn(path)`` as the producer of ``images/<name>``.

    Raises:
        ValueError: if ``name`` has a directory part, no file extension, or is already registered.
    """
    if os.path.basename(name) != name or "." not in name:
        raise ValueError(f"figure name must be a bare file name with an extension, got {name!r}")
    if name in FIGURES:
        raise ValueError(f"figure {name!r} is already registered (by {FIGURES[name].__module__})")

    def deco(fn: Callable[[Path], None]) -> Callable[[Path], None]:
        FIGURES[name] = fn
        return fn

    return deco


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    # no "Software"/date metadata: a regenerated PNG only differs from the committed one if the picture does
    fig.savefig(path, dpi=_DPI, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)


# ---- the runs -------------------------------------------------------------------------------------------------
def preemption_run():
    """Six requests, 12 KV blocks of 16 tokens, a 64-token budget, ``max_num_seqs=4``: chunked prefills, decodes
    and one preemption (request 3 at step 4). Returns the finished ``LLMEngine``; the same run as
    ``tests/course/test_viz.py``."""
    import numpy as np

    from minivllm import SamplingParams
    from minivllm.course.trace import TracedLLMEngine

    eng = TracedLLMEngine("tiny", num_gpu_blocks=12, max_num_batched_tokens=64, max_num_seqs=4)
    rng = np.random.default_rng(0)
    for n, m in zip([20, 33, 46, 59, 72, 85], [8, 11, 14, 17, 20, 23]):
        eng.add_request(None, {"prompt_token_ids": rng.integers(3, 500, n).tolist()},
                        SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
    eng.run_to_completion(max_steps=1000)
    return eng


def batching_runs(batch_size: int = 4):
    """``(static, continuous)`` ``BatchingRun``s of ``mixed_requests()`` on the tiny model with
    ``max_num_seqs=batch_size``, a 256-token budget and 64 blocks (no preemption)."""
    from minivllm.course.trace import TracedLLMEngine
    from minivllm.course.batching import mixed_requests, run_continuous, run_static

    prompts, params = mixed_requests()

    def engine():
        return TracedLLMEngine("tiny", max_num_seqs=batch_size, max_num_batched_tokens=256,
                         num_gpu_blocks=64, enable_prefix_caching=False)

    return run_static(engine(), prompts, params, batch_size), run_continuous(engine(), prompts, params)


# ---- the figures ----------------------------------------------------------------------------------------------
@register("queue_frame_preemption.png")
def queue_frame_preemption(path: Path) -> None:
    """The step in which request 3 is preempted: queues, budget, KV blocks by owner."""
    from minivllm.course.viz import save_frame_png

    trace = preemption_run().trace
    step = trace.preemptions()[0][0]
    save_frame_png(trace, step, path, dpi=_DPI)


@register("timeline_preemption.png")
def timeline_preemption(path: Path) -> None:
    """Timeline, tokens per step and free blocks of the preemption run."""
    import matplotlib.pyplot as plt

    from minivllm.course.viz import plot_free_blocks, plot_timeline, plot_tokens_per_step

    trace = preemption_run().trace
    fig, axes = plt.subplots(3, 1, figsize=(10, 7.5), sharex=True, gridspec_kw={"height_ratios": [1.4, 1, 1]})
    plot_timeline(trace, axes[0], title=_("6 requests, 12 KV blocks, budget 64 tokens, max_num_seqs 4"))
    plot_tokens_per_step(trace, axes[1], title="")
    plot_free_blocks(trace, axes[2], title="")
    fig.tight_layout()
    _save(fig, path)


@register("static_vs_continuous.png")
def static_vs_continuous(path: Path) -> None:
    """The same 12 requests under static batching (batches of 4) and continuous batching (max_num_seqs 4)."""
    import matplotlib.pyplot as plt

    from minivllm.course.viz import batch_occupancy, plot_timeline

    static, cont = batching_runs()
    n = max(static.num_steps, cont.num_steps)
    fig, axes = plt.subplots(2, 1, figsize=(12, 6.5), sharex=True)
    for ax, run, name in ((axes[0], static, _("static batching")), (axes[1], cont, _("continuous batching"))):
        occ = batch_occupancy(run.trace).mean()
        plot_timeline(run.trace, ax, arrivals=run.arrivals,
                      title=_("{name}: {steps} steps, batch slots used {percent:.0f}% on average").format(
                          name=name, steps=run.num_steps, percent=100 * occ))
        ax.set_xlim(-0.5, n - 0.5)
    fig.tight_layout()
    _save(fig, path)


@register("latency_static_vs_continuous.png")
def latency_static_vs_continuous(path: Path) -> None:
    """Per-request latency (steps from arrival to last token) under both schedules."""
    import matplotlib.pyplot as plt
    import numpy as np

    from minivllm.course.viz import request_latencies
    from minivllm.course.viz.fonts import use_language_font

    static, cont = batching_runs()
    ls, lc = request_latencies(static.trace, static.arrivals), request_latencies(cont.trace, cont.arrivals)
    ids = static.request_ids
    x = np.arange(len(ids))
    use_language_font()
    fig, ax = plt.subplots(figsize=(9, 3.5))
    ax.bar(x - 0.2, [ls[r].latency_steps for r in ids], 0.4, label=_("static batching"), color="#bab0ac")
    ax.bar(x + 0.2, [lc[r].latency_steps for r in cont.request_ids], 0.4, label=_("continuous batching"),
           color="#4e79a7")
    outs = [static.outputs[r].outputs[0].token_ids for r in ids]
    ax.set_xticks(x, [_("{request}\n({n} out)").format(request=r, n=len(o)) for r, o in zip(ids, outs)], fontsize=8)
    ax.set_xlabel(_("request (output tokens)"))
    ax.set_ylabel(_("latency [engine steps]"))
    ax.set_title(_("Latency per request: arrival at step 0 to last token"))
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)


SERVE_MEASUREMENT = Path(__file__).resolve().parents[1] / "bench" / "serve" / "measurement_float32.json"
"""The README's ``bench serve`` against ``vllm serve`` measurement (its section Speed), as ``bench serve``'s
summary rows: a hand run needing vLLM's CPU build and half an hour, so the figure is redrawn from the record."""


@register("bench_serve_vs_vllm.png")
def bench_serve_vs_vllm(path: Path) -> None:
    """minivllm's server against vllm serve: the README's hand-run float32 measurement, latency against rate"""
    from minivllm.bench.serve.plot import plot_latency_vs_rate

    record = json.loads(SERVE_MEASUREMENT.read_text(encoding="utf-8"))
    _save(plot_latency_vs_rate(record["summary"]), path)


# ---- command line ---------------------------------------------------------------------------------------------
def load_all() -> Dict[str, Callable[[Path], None]]:
    """Import every module in ``FIGURE_MODULES`` and return the registry."""
    for mod in FIGURE_MODULES:
        importlib.import_module(mod)
    return FIGURES


def main(argv: Optional[List[str]] = None) -> int:
    """Regenerate figures. ``--list`` prints the names; ``--only NAME`` (repeatable) picks some; ``--out DIR``
    writes elsewhere than ``images/``; ``--lang zh_CN`` draws them in Chinese (every registered figure's text goes
    through gettext: the matplotlib figures' labels and the Graphviz diagrams' prose) into ``images/zh-CN/`` by
    default. The language is set for the drawing and restored after it. Returns the exit status (2 for an unknown
    name)."""
    import matplotlib

    matplotlib.use("Agg")
    p = argparse.ArgumentParser(prog="python -m minivllm figures", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None,
                   help="output folder (default: images/ of the course, images/zh-CN/ with --lang zh_CN)")
    p.add_argument("--lang", choices=LANGUAGES, default="en", help="the language of the figures' text (default: en)")
    p.add_argument("--only", action="append", default=None, help="a figure name (repeatable)")
    p.add_argument("--list", action="store_true", help="list the figure names and exit")
    a = p.parse_args([] if argv is None else argv)
    figures = load_all()
    if a.list:
        for name, fn in sorted(figures.items()):
            print(f"{name}: {(fn.__doc__ or '').strip().splitlines()[0] if fn.__doc__ else ''}")
        return 0
    names = a.only or sorted(figures)
    unknown = [n for n in names if n not in figures]
    if unknown:
        print(f"unknown figure(s): {', '.join(unknown)}; known: {', '.join(sorted(figures))}")
        return 2
    default_out = DEFAULT_OUT / ZH_SUBDIR if a.lang == "zh_CN" else DEFAULT_OUT
    out = Path(a.out) if a.out is not None else default_out
    if out == default_out and not (DEFAULT_OUT.parent / "notebooks").is_dir():
        # An installed package: parents[2] is site-packages, no place for the course's images.
        print(f"figures: images/ belongs to the minivllm repository, not to the installed package ({DEFAULT_OUT} "
              "would be inside site-packages); run this from a source checkout or pass --out DIR")
        return 2
    out.mkdir(parents=True, exist_ok=True)
    before = get_language()
    set_language(a.lang)
    try:
        for name in names:
            t = time.perf_counter()
            figures[name](out / name)
            print(f"[figures] {out / name} ({time.perf_counter() - t:.1f} s)")
    finally:
        set_language(before)
    return 0
