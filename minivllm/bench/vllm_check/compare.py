"""Step-by-step comparison of a vLLM recording with minivllm's replay of the same scenario and mode.

Compared per step (see ``driver.py`` for the fields): scheduled tokens per request, new / cached / resumed ids,
the new requests' block tables,
the prefix-cache hit of each admitted request, preempted ids in order, ``finished_req_ids``, the waiting and
running queues, free blocks, the sampled tokens, the finished requests with their reasons, and the KV-connector
calls (see ``connector_signature``). Then the final outputs (greedy tokens and finish reasons in the live mode).

Known differences (``KNOWN_DIFFERENCES``): behaviours of vLLM that minivllm does not reproduce yet. Each is
normalised away before comparing, printed by the check, and pinned by a test that fails once it is gone (so the
entry is removed with the fix); ``strict=True`` compares without them.

Block ids are compared shifted by one: vLLM numbers its blocks from 1 (block 0 is its null block), minivllm from
0, so vLLM's block ``b`` is minivllm's ``b - 1`` (the new requests' block tables, and the block ids the connector
gets in ``update_state_after_alloc`` and ``request_finished``).

Not compared: the connector hooks only vLLM has (``update_connector_output``, ``build_connector_worker_meta``,
``wait_for_layer_load``, ``handle_preemptions``; recorded all the same).
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

from minivllm.i18n import _

STEP_FIELDS = ("num_scheduled_tokens", "new", "cached", "resumed", "num_computed_at_admission", "preempted",
               "finished_req_ids", "waiting", "running", "num_free_blocks", "sampled", "finished")
COMMON_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "request_finished",
                "bind_connector_metadata", "start_load_kv", "save_kv_layer", "wait_for_save", "get_finished",
                "clear_connector_metadata")


KNOWN_DIFFERENCES = {
    "start_load_kv_after_forward": (
        "vLLM 0.32's V1 runner calls the worker-side start_load_kv *after* the forward pass (after the per-layer "
        "save_kv_layer calls) when the step has no synchronous KV load (scheduler_output.has_sync_kv_loads is "
        "False; vllm/v1/worker/kv_connector_model_runner_mixin.py, _get_kv_connector_output, start_after_forward); "
        "minivllm always calls it before the forward pass. Compared with vLLM's start_load_kv moved back to just "
        "before its save_kv_layer calls."
    ),
    "uncached_blocks_prepended_in_order": (
        "vLLM 0.32's BlockPool.free_blocks puts the freed blocks that hold no hash (all of them with prefix "
        "caching off) at the front of the free queue with one prepend_n, keeping their order (a request's "
        "blocks are freed last block first, so its last block is reused first); minivllm prepends them one by "
        "one, which reverses them. Same blocks, other order: seen in preempt_youngest_recompute, where the resumed "
        "request gets vLLM blocks [5, 2, 1] (minivllm's [4, 1, 0]) and minivllm gives [0, 1, 4]. Compared with "
        "each block table sorted."
    ),
}


def _normalise_known(sig: List[str]) -> List[str]:
    out = list(sig)
    for i in range(len(out) - 1):
        if out[i].startswith("save_kv_layer*") and out[i + 1] == "start_load_kv":
            out[i], out[i + 1] = out[i + 1], out[i]
    return out


def _blocks(ids: List[int], offset: int, strict: bool) -> List[int]:
    out = [int(b) - offset for b in ids]
    return out if strict else sorted(out)


def connector_signature(calls: List[Dict[str, Any]], scheduler_side_only: bool = False,
                        strict: bool = True, block_id_offset: int = 0) -> List[str]:
    """The compared form of one step's connector calls: one string per call, in order, with the arguments that
    both engines define the same way. Consecutive ``save_kv_layer`` calls (one per layer) collapse into one
    entry ``save_kv_layer*N`` (recorded as one ``layer_hooks`` record). Hooks only one engine has are dropped.
    ``block_id_offset``: subtracted from block ids (1 for vLLM's recordings)."""
    out: List[str] = []
    run = 0
    for c in calls:
        name = c["call"]
        if scheduler_side_only and c.get("side") != "scheduler":
            continue
        if name == "layer_hooks":  # wait_for_layer_load (vLLM only) is dropped, save_kv_layer counted
            if "save_kv_layer" in c["per_layer"]:
                run += c["num_layers"]
            continue
        if name not in COMMON_HOOKS:
            continue
        if run:
            out.append(f"save_kv_layer*{run}")
            run = 0
        if name == "get_num_new_matched_tokens":
            out.append(f"{name}({c['req_id']}, num_computed_tokens={c['num_computed_tokens']})")
        elif name == "update_state_after_alloc":
            ids = [b for g in c.get("block_ids", []) for b in g]
            out.append(f"{name}({c['req_id']}, blocks={_blocks(ids, block_id_offset, strict)}, "
                       f"num_external_tokens={c['num_external_tokens']})")
        elif name == "build_connector_meta":
            out.append(f"{name}(new={c['new']}, cached={c['cached']}, resumed={c['resumed']})")
        elif name == "request_finished":
            out.append(f"{name}({c['req_id']}, blocks={_blocks(c.get('block_ids', []), block_id_offset, strict)})")
        else:
            out.append(name)
    if run:
        out.append(f"save_kv_layer*{run}")
    return out if strict else _normalise_known(out)


def _step_view(rec: Optional[Dict[str, Any]], scheduler_side_only: bool, strict: bool,
               block_id_offset: int) -> Dict[str, Any]:
    if rec is None:
        return {}
    v = {f: rec.get(f) for f in STEP_FIELDS}
    v["finished"] = dict(sorted((rec.get("finished") or {}).items()))
    v["new_block_ids"] = {rid: _blocks([b for g in groups for b in g], block_id_offset, strict)
                          for rid, groups in (rec.get("new_block_ids") or {}).items()}
    v["connector_calls"] = connector_signature(rec.get("connector_calls", []), scheduler_side_only, strict,
                                               block_id_offset)
    return v


def compare_run(vllm_run: Dict[str, Any], mini_run: Dict[str, Any], live: bool,
                strict: bool = False) -> Tuple[bool, str]:
    """``(equal, report)``: the first differing step side by side, or the differing outputs.

    In the live mode the worker-side connector calls are compared too; in the scheduler-only modes only the
    scheduler side (no model runner runs on vLLM's side there). ``strict``: no known difference is excused.
    """
    vs, ms = vllm_run["steps"], mini_run["steps"]
    for i in range(max(len(vs), len(ms))):
        a = _step_view(vs[i] if i < len(vs) else None, not live, strict, 1)
        b = _step_view(ms[i] if i < len(ms) else None, not live, strict, 0)
        if a == b:
            continue
        keys = list(a or b)
        lines = [_("first difference at step {step} (vLLM has {vllm} steps, minivllm {mini}):").format(
                     step=i, vllm=len(vs), mini=len(ms)),
                 f"  {'field':<26} {'vLLM':<48} minivllm"]
        for k in keys:
            va, vb = a.get(k, "(no step)"), b.get(k, "(no step)")
            mark = "  " if va == vb else "≠ "
            if k == "connector_calls" and va != vb:
                lines.append(f"{mark}{k}:")
                n = max(len(va) if isinstance(va, list) else 0, len(vb) if isinstance(vb, list) else 0)
                for j in range(n):
                    x = va[j] if isinstance(va, list) and j < len(va) else ""
                    y = vb[j] if isinstance(vb, list) and j < len(vb) else ""
                    lines.append(f"    {'≠' if x != y else ' '} {x:<70} {y}")
                continue
            lines.append(f"{mark}{k:<24} {json.dumps(va):<48} {json.dumps(vb)}")
        return False, "\n".join(lines)
    if live:
        vo, mo = vllm_run.get("outputs", {}), mini_run.get("outputs", {})
        diffs = []
        for rid in sorted(set(vo) | set(mo)):
            x, y = vo.get(rid, {}), mo.get(rid, {})
            for k in ("token_ids", "finish_reason", "num_cached_tokens"):
                if x.get(k) != y.get(k):
                    diffs.append(f"  {rid}.{k}: vLLM {x.get(k)}  minivllm {y.get(k)}")
        if diffs:
            return False, _("outputs differ:") + "\n" + "\n".join(diffs)
    return True, _("{n} steps equal").format(n=len(vs))
