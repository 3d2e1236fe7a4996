"""One step's flattened batch, drawn from an engine run: rows, positions, slots and the logits rows.

The model runner turns a step into one flattened batch (``ModelRunnerBase._prepare_inputs``; vLLM
``GPUModelRunner._prepare_inputs``): the scheduled tokens of every request one after the other, no batch dimension,
no padding. ``draw_flattened_batch`` draws a step recorded by ``TracedLLMEngine(..., record_inputs=True)``:

* top: the batch rows, one coloured run per request from ``query_start_loc[i]`` to ``query_start_loc[i + 1]``,
  labelled with the request, its rows and its context (``num_computed_tokens``);
* middle: each row's position (``positions``): ``num_computed_tokens + 0, 1, ...`` within each request;
* bottom: each row's KV cache slot (``slot_mapping``), with the KV block it falls in written at each run of
  consecutive slots: where a request's block table is not consecutive, its slots jump;
* every panel: the rows in ``logits_indices`` (the last row of each request, the only ones the LM head sees),
  marked ``sampled`` or ``discarded`` (``discard_mask``: a partial prefill).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from minivllm.course.viz.colors import PALETTE, text_color
from minivllm.course.viz.fonts import use_language_font
from minivllm.i18n import _, ngettext

__all__ = ["draw_flattened_batch", "batch_segments"]


def _inputs_of(step: Any) -> Dict[str, Any]:
    inputs = step.inputs if hasattr(step, "inputs") else step
    if not inputs:
        raise ValueError("this step has no recorded inputs: record the run with TracedLLMEngine(..., "
                         "record_inputs=True) and pick a step that ran the model")
    missing = [f for f in ("req_ids", "query_start_loc", "positions", "slot_mapping", "logits_indices")
               if f not in inputs]
    if missing:
        raise ValueError(f"the step's inputs lack {missing}")
    return inputs


def batch_segments(step: Any) -> List[Dict[str, Any]]:
    """Per request, in batch order: ``{"request", "rows": (start, end), "positions": (first, last), "slots":
    [(first, last), ...] runs of consecutive slots, "logits_row", "discarded"}``; what the picture shows, as data.

    Args:
        step: a ``StepRecord`` with ``inputs`` (or its ``inputs`` dict).

    Raises:
        ValueError: when the step has no recorded inputs.
    """
    x = _inputs_of(step)
    qsl = list(x["query_start_loc"])
    discard = list(x.get("discard_mask") or [False] * len(x["req_ids"]))
    out = []
    for i, rid in enumerate(x["req_ids"]):
        a, b = qsl[i], qsl[i + 1]
        slots = list(x["slot_mapping"][a:b])
        runs, start = [], 0
        for k in range(1, len(slots) + 1):
            if k == len(slots) or slots[k] != slots[k - 1] + 1:
                runs.append((slots[start], slots[k - 1]))
                start = k
        out.append({"request": rid, "rows": (a, b - 1), "positions": (x["positions"][a], x["positions"][b - 1]),
                    "slots": runs, "logits_row": x["logits_indices"][i], "discarded": bool(discard[i])})
    return out


def draw_flattened_batch(step: Any, block_size: int, colors: Optional[Dict[str, str]] = None,
                         title: Optional[str] = None, width: float = 10.0):
    """Draw one step's flattened batch (see the module docstring). Returns the matplotlib ``Figure``.

    Args:
        step: a ``StepRecord`` recorded with ``record_inputs=True`` (or its ``inputs`` dict).
        block_size: tokens per KV block (to name the block of each run of slots: ``slot // block_size``).
        colors: ``request id -> colour`` (e.g. ``owner_colors(trace)``); default: the palette in batch order.
        title: the figure's title; default names the step and its tokens.
        width: figure width in inches.

    Raises:
        ValueError: when the step has no recorded inputs, or ``block_size < 1``.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    x = _inputs_of(step)
    segs = batch_segments(x)
    use_language_font()
    rids: Sequence[str] = x["req_ids"]
    colors = colors or {rid: PALETTE[i % len(PALETTE)] for i, rid in enumerate(rids)}
    total = x["query_start_loc"][-1]
    fig, (ax0, ax1, ax2) = plt.subplots(3, 1, figsize=(width, 5.6), sharex=True,
                                        gridspec_kw={"height_ratios": [1.1, 2, 2]})
    computed = x.get("num_computed_tokens") or [s["positions"][0] for s in segs]
    for i, s in enumerate(segs):
        a, b = s["rows"]
        c = colors.get(s["request"], PALETTE[i % len(PALETTE)])
        ax0.add_patch(Rectangle((a - 0.5, 0), b - a + 1, 1, facecolor=c, edgecolor="black", linewidth=0.8))
        label = ngettext("{request}: {n} row, context {context}", "{request}: {n} rows, context {context}",
                         b - a + 1).format(request=s["request"], n=b - a + 1, context=computed[i])
        if b - a + 1 < max(6, total // 12):
            label = s["request"]
        ax0.text((a + b) / 2, 0.5, label, ha="center", va="center", fontsize=8, color=text_color(c))
        rows = list(range(a, b + 1))
        ax1.plot(rows, x["positions"][a:b + 1], marker="o", markersize=2.5, linewidth=1, color=c)
        ax2.plot(rows, x["slot_mapping"][a:b + 1], marker="o", markersize=2.5, linewidth=0, color=c)
        row = a
        for first, last in s["slots"]:
            blocks = sorted({p // block_size for p in range(first, last + 1)})
            name = (_("block {block}").format(block=blocks[0]) if len(blocks) == 1
                    else _("blocks {first}..{last}").format(first=blocks[0], last=blocks[-1]))
            ax2.annotate(name, (row, first), textcoords="offset points", xytext=(2, 6), fontsize=7, color=c)
            row += last - first + 1
        lr = s["logits_row"]
        for ax in (ax0, ax1, ax2):
            ax.axvline(lr, color=c, linestyle=":", linewidth=1)
        ax0.plot([lr], [1.15], marker="x" if s["discarded"] else "*", markersize=7, linestyle="none",
                 color="#777777" if s["discarded"] else "black")
    for q in x["query_start_loc"]:
        ax0.axvline(q - 0.5, color="black", linewidth=0.6)
    from matplotlib.lines import Line2D

    ax0.legend(handles=[Line2D([], [], marker="*", color="black", linestyle="none", label=_("logits row, token kept")),
                        Line2D([], [], marker="x", color="#777777", linestyle="none",
                               label=_("logits row, token discarded (partial prefill)"))],
               loc="upper center", bbox_to_anchor=(0.5, 1.62), ncol=2, fontsize=7, frameon=False)
    ax0.set_ylim(0, 1.3)
    ax0.set_yticks([])
    ax0.set_ylabel(_("requests"), fontsize=8)
    ax1.set_ylabel(_("positions"), fontsize=8)
    ax2.set_ylabel("slot_mapping", fontsize=8)
    ax2.set_xlabel(_("batch row (query_start_loc = {query_start_loc}; dotted: logits_indices = "
                     "{logits_indices})").format(query_start_loc=list(x["query_start_loc"]),
                                                 logits_indices=list(x["logits_indices"])), fontsize=8)
    ax2.set_xlim(-0.5, total - 0.5)
    for ax in (ax1, ax2):
        ax.grid(True, linewidth=0.3)
        ax.tick_params(labelsize=8)
    step_no = getattr(step, "step", None)
    default = ngettext("one flattened batch of {rows} rows, {n} request",
                       "one flattened batch of {rows} rows, {n} requests", len(rids)).format(rows=total, n=len(rids))
    if step_no is not None:
        default = _("step {step}: ").format(step=step_no) + default
    fig.suptitle(title or default, fontsize=10)
    fig.tight_layout()
    return fig
