"""A block table drawn as what it is: a map from a request's logical blocks to physical blocks of the pool.

Logical block ``i`` of a request holds its tokens ``i * block_size ... (i + 1) * block_size - 1``; its block table
says which physical block of the KV cache stores them (``block_table[i]``). The picture puts every request's
logical blocks side by side on top, the pool's physical blocks below, and one arrow per block-table entry, from
one recorded step of an engine run (``SchedulerTrace``; notebook 03). vLLM keeps the same map per request in
``vllm/v1/core/single_type_kv_cache_manager.py`` (``req_to_blocks``) and per batch row in
``vllm/v1/worker/block_table.py`` (``BlockTable``).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from minivllm.course.trace import StepRecord
from minivllm.course.viz.colors import FREE_COLOR, PALETTE
from minivllm.course.viz.fonts import use_language_font
from minivllm.i18n import _


def block_table_arrows(record: StepRecord, request_ids: Optional[Sequence[str]] = None) -> List[Tuple[str, int, int]]:
    """``(request id, logical block, physical block)`` for every block-table entry of ``request_ids`` (default: every
    request holding blocks at that step, in the record's order). Raises ``KeyError`` naming an unknown request."""
    ids = [rid for rid, r in record.requests.items() if r.block_ids] if request_ids is None else list(request_ids)
    out: List[Tuple[str, int, int]] = []
    for rid in ids:
        if rid not in record.requests:
            raise KeyError(f"request {rid!r} is not in step {record.step}; it has {sorted(record.requests)}")
        out.extend((rid, i, b) for i, b in enumerate(record.requests[rid].block_ids))
    return out


def draw_block_table_map(record: StepRecord, block_size: int, ax=None, request_ids: Optional[Sequence[str]] = None,
                         colors: Optional[Dict[str, str]] = None) -> List[Tuple[str, int, int]]:
    """Draw step ``record``'s block tables as maps from logical to physical blocks; returns the arrows drawn
    (``block_table_arrows``).

    Top row: each request's logical blocks in order, labelled with the token positions they hold and filled up to
    the request's ``num_computed_tokens``. Bottom row: the pool's ``num_gpu_blocks`` physical blocks, coloured by
    owner (grey: free). One arrow per entry: logical block ``i`` -> physical block ``block_table[i]``.

    Args:
        record: one step of a ``SchedulerTrace``.
        block_size: tokens per block (> 0).
        ax: a matplotlib axes (default: a new figure sized to the pool).
        request_ids: the requests to draw (default: all holding blocks).
        colors: ``request id -> colour`` (default: the palette in ``request_ids`` order).

    Raises:
        ValueError: for ``block_size < 1``.
        KeyError: for a request not in ``record``.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    arrows = block_table_arrows(record, request_ids)
    use_language_font()
    ids = list(dict.fromkeys(rid for rid, _i, _b in arrows))
    colors = colors or {rid: PALETTE[i % len(PALETTE)] for i, rid in enumerate(ids)}
    n_pool = record.num_gpu_blocks
    n_logical = len(arrows) + max(0, len(ids) - 1)  # one empty block's width between requests
    width = max(n_pool, n_logical)
    if ax is None:
        _fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * width), 3.2))
    use_language_font(ax)
    # physical pool
    owners = record.block_owners
    for b in range(n_pool):
        who = owners[b][0] if b < len(owners) and owners[b] else None
        face = colors.get(who, "#bbbbbb") if who else FREE_COLOR
        ax.add_patch(Rectangle((b, 0), 0.9, 0.9, facecolor=face, edgecolor="black", linewidth=0.6,
                               alpha=1.0 if who in colors else 0.5))
        ax.text(b + 0.45, -0.15, str(b), ha="center", va="top", fontsize=7)
    ax.text(-0.4, 0.45, _("physical\nblocks"), ha="right", va="center", fontsize=8)
    # logical blocks, request by request
    x = (width - n_logical) / 2
    y = 3.0
    top: Dict[Tuple[str, int], float] = {}
    for rid in ids:
        r = record.requests[rid]
        c = colors[rid]
        start = x
        for i, _b in enumerate(r.block_ids):
            filled = max(0, min(block_size, r.num_computed_tokens - i * block_size))
            ax.add_patch(Rectangle((x, y), 0.9, 0.9, facecolor="white", edgecolor=c, linewidth=1.2))
            if filled:
                ax.add_patch(Rectangle((x, y), 0.9 * filled / block_size, 0.9, facecolor=c, alpha=0.45,
                                       edgecolor="none"))
            ax.text(x + 0.45, y + 0.45, str(i), ha="center", va="center", fontsize=8, fontweight="bold")
            ax.text(x + 0.45, y + 1.0, f"{i * block_size}-{(i + 1) * block_size - 1}", ha="center", va="bottom",
                    fontsize=6, color="#555555")
            top[(rid, i)] = x + 0.45
            x += 1
        ax.text((start + x - 0.1) / 2, y + 1.45, _("{request}: {n} tokens").format(request=rid, n=r.num_computed_tokens), ha="center",
                va="bottom", fontsize=8, color=c, fontweight="bold")
        x += 1
    ax.text(-0.4, y + 0.45, _("logical\nblocks"), ha="right", va="center", fontsize=8)
    for rid, i, b in arrows:
        ax.annotate("", xy=(b + 0.45, 0.95), xytext=(top[(rid, i)], y - 0.05),
                    arrowprops=dict(arrowstyle="->", color=colors[rid], linewidth=1.0, shrinkA=0, shrinkB=0))
    ax.set_xlim(-2.2, width + 0.2)
    ax.set_ylim(-0.8, y + 2.0)
    ax.axis("off")
    ax.set_title(_("step {step}: block_table[i] maps logical block i (tokens i*{block_size} .. "
                   "i*{block_size}+{last}) to a physical block").format(step=record.step, block_size=block_size,
                                                                        last=block_size - 1),
                 fontsize=9, loc="left")
    return arrows
