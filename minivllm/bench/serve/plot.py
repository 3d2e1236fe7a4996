"""Latency against request rate, one line per server: p50 and p99 TTFT, p50 ITL and output throughput, each the
median over repeats with the min-max range as error bars. ``inf`` (all requests at once) is drawn at the right
end, at twice the largest finite rate, and labelled "inf"."""

from __future__ import annotations

import math
from typing import Dict, List, Optional


def _x(rates: List[float]) -> Dict[float, float]:
    finite = [r for r in rates if math.isfinite(r)]
    far = 2 * max(finite) if finite else 1.0
    return {r: (r if math.isfinite(r) else far) for r in rates}


def plot_latency_vs_rate(summary: List[dict], path: Optional[str] = None, title: Optional[str] = None):
    """Draw ``summary`` (``cli.summarize``'s rows) and save it to ``path`` (PNG) when given. Returns the figure."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    from minivllm.course.viz.fonts import use_language_font
    from minivllm.i18n import _

    use_language_font()  # before the figure: its texts take the font list of the moment they are made
    rates = sorted({r["request_rate"] for r in summary})
    xs = _x(rates)
    panels = [("ttft_p99_ms", _("p99 time to first token (ms)")), ("itl_p50_ms", _("p50 inter-token latency (ms)")),
              ("e2el_p99_ms", _("p99 end-to-end latency (ms)")), ("output_tok_s", _("output tokens/s"))]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4))
    for ax, (key, label) in zip(axes, panels):
        for target in dict.fromkeys(r["target"] for r in summary):
            rows = sorted((r for r in summary if r["target"] == target and r[key] is not None),
                          key=lambda r: r["request_rate"])
            if not rows:
                continue
            x = [xs[r["request_rate"]] for r in rows]
            med = [r[key]["median"] for r in rows]
            err = [[m - r[key]["min"] for m, r in zip(med, rows)], [r[key]["max"] - m for m, r in zip(med, rows)]]
            ax.errorbar(x, med, yerr=err, marker="o", capsize=3, label=target)
        ax.set_xticks([xs[r] for r in rates], [f"{r:g}" for r in rates])
        ax.set_xlabel(_("request rate (req/s)"))
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title or _("open-loop load: latency against request rate (median of repeats, min-max bars)"))
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return fig
