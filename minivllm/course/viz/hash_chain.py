"""The block-hash chain of requests in an engine run (notebook 07): each full block's hash is computed from its
parent's hash and its own tokens, so one hash names the whole prefix up to that block.

``hash_chain_rows`` reads the chain of each request (``Request.block_hashes``, extended by the engine as the
request's tokens fill blocks; vLLM ``get_request_block_hasher``) and, given the block pool, where each hash is
cached (``BlockPool.get_cached_block``); ``draw_hash_chain`` draws it with matplotlib: one row per request, one box
per full block (its tokens, its parent's hash and its own), an arrow from parent to child, the same colour for the
same hash in several rows (a prefix-cache hit: one physical block), and the partly filled last block, which has
no hash yet, dashed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from minivllm.core.kv_cache_utils import NONE_HASH
from minivllm.course.viz.fonts import monospace, use_language_font
from minivllm.i18n import _

HEX = 8  # hex digits of a hash shown


@dataclass
class ChainBlock:
    """One full block of a request's chain.

    Attributes:
        index: the block's position in the request (block ``index`` holds tokens ``index * block_size`` onwards).
        tokens: its ``block_size`` token ids.
        parent: the first ``HEX`` hex digits of its parent's hash (``NONE_HASH`` for block 0).
        hash: the first ``HEX`` hex digits of its own hash.
        cached_block_id: the physical block holding this hash in the pool's map, ``None`` when it is not cached
            (or no pool was given).
    """

    index: int
    tokens: List[int]
    parent: str
    hash: str
    cached_block_id: Optional[int]


def hash_chain_rows(requests: Sequence[Any], block_size: int, block_pool: Any = None) -> Dict[str, List[ChainBlock]]:
    """request id -> its chain of full blocks, in order.

    Args:
        requests: ``minivllm.request.Request`` objects (``request_id``, ``all_token_ids``, ``block_hashes``).
        block_size: tokens per block (the engine's ``cache_config.block_size``).
        block_pool: the engine's ``BlockPool``, to say where each hash is cached; ``None`` leaves it out.

    Raises:
        ValueError: ``block_size`` < 1, or a request with more hashes than full blocks of tokens.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    out: Dict[str, List[ChainBlock]] = {}
    for r in requests:
        tokens = list(r.all_token_ids)
        if len(r.block_hashes) > len(tokens) // block_size:
            raise ValueError(f"request {r.request_id!r} has {len(r.block_hashes)} block hashes for {len(tokens)} "
                             f"tokens: block_size {block_size} is not the engine's")
        row, parent = [], NONE_HASH
        for i, h in enumerate(r.block_hashes):
            cached = block_pool.get_cached_block(h) if block_pool is not None else None
            row.append(ChainBlock(i, tokens[i * block_size:(i + 1) * block_size], parent.hex()[:HEX], h.hex()[:HEX],
                                  None if cached is None else cached.block_id))
            parent = h
        out[r.request_id] = row
    return out


def draw_hash_chain(requests: Sequence[Any], block_size: int, block_pool: Any = None, ax: Any = None,
                    title: Optional[str] = None) -> Any:
    """Draw the hash chains of ``requests`` (see ``hash_chain_rows``); returns the matplotlib axes.

    A hash that appears in more than one row gets one colour in all of them (the same prefix: one cached block,
    shared); a hash of one row only is grey. Below each box: the physical block that holds the hash in the pool's
    map (``block 3``), or ``not cached``.
    """
    import matplotlib.pyplot as plt

    rows = hash_chain_rows(requests, block_size, block_pool)
    use_language_font()
    seen: Dict[str, int] = {}
    for row in rows.values():
        for b in row:
            seen[b.hash] = seen.get(b.hash, 0) + 1
    palette = [plt.get_cmap("tab10")(k) for k in range(10)]
    shared = [h for h in dict.fromkeys(b.hash for row in rows.values() for b in row) if seen[h] > 1]
    colour = {h: palette[(2 + k) % len(palette)] for k, h in enumerate(shared)}
    by_id = {r.request_id: r for r in requests}
    tails = {rid: list(by_id[rid].all_token_ids)[len(row) * block_size:] for rid, row in rows.items()}
    width = max([len(row) + (1 if tails[rid] else 0) for rid, row in rows.items()] + [1]) + 1
    if ax is None:
        _fig, ax = plt.subplots(figsize=(2.3 * (width + 0.6), 1.35 * len(rows) + 0.4))
    use_language_font(ax)
    for y, (rid, row) in enumerate(reversed(list(rows.items()))):
        ax.text(-0.35, y + 0.4, rid, ha="right", va="center", fontsize=10, fontweight="bold")
        ax.text(0, y + 0.4, f"NONE_HASH\n{NONE_HASH.hex()[:HEX]}", ha="left", va="center", fontsize=7, color="grey")
        for b in row:
            x = b.index + 1
            face = colour.get(b.hash, "#e6e6e6")
            ax.add_patch(plt.Rectangle((x, y + 0.05), 0.8, 0.7, facecolor=face, edgecolor="black", alpha=0.85))
            ax.text(x + 0.4, y + 0.55, " ".join(str(t) for t in b.tokens), ha="center", va="center", fontsize=6.5)
            ax.text(x + 0.4, y + 0.3, _("hash {hash}").format(hash=b.hash), ha="center", va="center", fontsize=7, family=monospace())
            where = _("not cached") if b.cached_block_id is None else _("block {block}").format(block=b.cached_block_id)
            ax.text(x + 0.4, y - 0.05, where, ha="center", va="center", fontsize=6.5, color="dimgrey")
            ax.annotate("", xy=(x, y + 0.4), xytext=(x - 0.2 if b.index else x - 0.3, y + 0.4),
                        arrowprops=dict(arrowstyle="->", color="black", lw=0.8))
        tail = tails[rid]
        if tail:
            x = len(row) + 1
            ax.add_patch(plt.Rectangle((x, y + 0.05), 0.8, 0.7, facecolor="white", edgecolor="grey", linestyle="--"))
            ax.text(x + 0.4, y + 0.55, " ".join(str(t) for t in tail), ha="center", va="center", fontsize=6.5,
                    color="grey")
            ax.text(x + 0.4, y + 0.3, _("no hash yet\n(partly filled)"), ha="center", va="center", fontsize=6.5,
                    color="grey")
    ax.set_xlim(-0.9, width)
    ax.set_ylim(-0.3, len(rows))
    ax.axis("off")
    ax.set_title(title or _("block-hash chain: hash(block i) = H(hash(block i-1), tokens of block i); "
                            "same colour = same hash, one shared block"), fontsize=9)
    return ax


__all__ = ["ChainBlock", "HEX", "draw_hash_chain", "hash_chain_rows"]
