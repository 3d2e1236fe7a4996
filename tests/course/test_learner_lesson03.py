"""Lesson 03's parts (issue 26): the checkers of slot_mapping, write_kv, gather_kv and paged_attention (the
solutions pass, blanks are blank, known wrong answers fail naming the difference), the learner's attention backend
inside the engine, and the grader on the committed notebooks."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from minivllm import LLMEngine, SamplingParams
from minivllm.course.exercises import fallback
from minivllm.course.learner import cells, grade, parts
from minivllm.course.learner.lesson03 import learner_attention_backend

ROOT = Path(__file__).resolve().parents[2]
BLANK = ROOT / "notebooks" / "03_paged_kv_blocks.ipynb"
SOLUTIONS = ROOT / "notebooks" / "solutions" / "03_paged_kv_blocks_solutions.ipynb"
PARTS = ("slot_mapping", "write_kv", "gather_kv", "paged_attention")


@pytest.fixture(scope="module")
def solved():
    """The namespace the solutions notebook's exercise cells run in (as the grader runs them)."""
    ns = cells.run_cells(cells.exercise_cells(str(SOLUTIONS)), str(SOLUTIONS))
    assert ns["__errors__"] == {}
    return ns


def status(name, fn):
    return parts.run_check(parts.get(name), fn, hidden=True)


def failure(name, fn):
    st, msg = status(name, fn)
    assert st == "failed", (st, msg)
    return msg


@pytest.mark.parametrize("name", PARTS)
def test_the_solutions_and_the_references_pass_with_the_hidden_cases(name, solved):
    part = parts.get(name)
    assert part.lesson == "03" and part.kind == "attention" and len(part.hints) == 3
    st, msg = status(name, solved[name])
    assert st == "passed", msg
    n_visible = part.check(solved[name], False)
    n_all = part.check(solved[name], True)
    assert n_all > n_visible >= 3
    assert status(name, getattr(fallback, name))[0] == "passed"
    assert part.reference is getattr(fallback, name)


@pytest.mark.parametrize("name", PARTS)
def test_a_blank_part_is_blank(name):
    def blank(*args):
        raise NotImplementedError  # your code here

    assert status(name, blank)[0] == "blank"
    assert status(name, None)[0] == "blank"


# ---- known wrong answers, each named -------------------------------------------------------------------------
def test_slot_mapping_wrong_variants_are_named():
    msg = failure("slot_mapping", lambda bt, pos, bs: list(pos))
    assert "block_table=[3], positions=[0, 1, 2]" in msg and "expected slots [12, 13, 14], got [0, 1, 2]" in msg
    assert "look the block up in the block table" in msg
    msg = failure("slot_mapping", lambda bt, pos, bs: [bt[p // bs] + p % bs for p in pos])
    assert "multiply the block id by block_size" in msg
    msg = failure("slot_mapping", lambda bt, pos, bs: [bt[i // bs] * bs + i % bs for i, _ in enumerate(pos)])
    assert "positions=[6..10]" in msg and "use each token's position p" in msg


def test_write_kv_wrong_variants_are_named():
    def into_a_copy(cache, k, v, slots):
        bs = cache.shape[2]
        cache[0][slots // bs][:, 0] = k  # advanced indexing copies: the cache never changes

    msg = failure("write_kv", into_a_copy)
    assert "slot_mapping=[5, 6, 7]" in msg and "the cache did not change" in msg

    def swapped(cache, k, v, slots):
        fallback.write_kv(cache, v, k, slots)

    assert "keys go to kv_cache[0] and values to kv_cache[1]" in failure("write_kv", swapped)

    def block_size_four(cache, k, v, slots):  # passes the notebook's cases, which all have block_size 4
        cache[0, slots // 4, slots % 4] = k
        cache[1, slots // 4, slots % 4] = v

    assert parts.get("write_kv").check(block_size_four, False) == 3
    msg = failure("write_kv", block_size_four)
    assert "a hidden case" in msg and "block_size 8" in msg and "not from the notebook's examples" in msg


def test_gather_kv_wrong_variants_are_named():
    def all_blocks(cache, bt, n):
        k, v = fallback.gather_kv(cache, bt, -(-n // cache.shape[2]) * cache.shape[2])
        return k, v

    msg = failure("gather_kv", all_blocks)
    assert "seq_len=6" in msg and "keep only the first seq_len rows" in msg

    def blocks_in_order(cache, bt, n):
        return fallback.gather_kv(cache, torch.arange(len(bt)), n)

    assert "not blocks 0, 1, 2" in failure("gather_kv", blocks_in_order)

    def block_size_four(cache, bt, n):  # passes the notebook's cases (all block_size 4); reads too little at 1
        h, d = cache.shape[3:]
        nblk = -(-n // 4)
        return (cache[0, bt[:nblk]].reshape(-1, h, d)[:n], cache[1, bt[:nblk]].reshape(-1, h, d)[:n])

    assert parts.get("gather_kv").check(block_size_four, False) == 4
    msg = failure("gather_kv", block_size_four)
    assert "a hidden case" in msg and "block_size=1" in msg and "not from the notebook's examples" in msg


def _attend(q, cache, bt, n, *, mask_shift=True, interleave=True, scale=None, bs=None):
    t, h, d = q.shape
    bs = bs or cache.shape[2]
    seq = n + t
    nblk = -(-seq // bs)
    k = cache[0, bt[:nblk]].reshape(-1, *cache.shape[3:])[:seq]
    v = cache[1, bt[:nblk]].reshape(-1, *cache.shape[3:])[:seq]
    g = h // k.shape[1]
    k, v = (k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)) if interleave else (k.repeat(1, g, 1), v.repeat(1, g, 1))
    scores = torch.einsum("qhd,khd->hqk", q, k) * (d ** -0.5 if scale is None else scale)
    allowed = torch.arange(seq)[None, :] <= (torch.arange(t) + (n if mask_shift else 0))[:, None]
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


def test_paged_attention_wrong_variants_are_named():
    assert status("paged_attention", _attend)[0] == "passed"  # the helper below is right with its defaults
    msg = failure("paged_attention", lambda q, c, b, n: _attend(q, c, b, n, mask_shift=False))
    assert "decode" in msg and "num_computed + i" in msg
    msg = failure("paged_attention", lambda q, c, b, n: _attend(q, c, b, n, interleave=False))
    assert "repeat_interleave, not repeat" in msg
    msg = failure("paged_attention", lambda q, c, b, n: _attend(q, c, b, n, scale=1.0))
    assert "1 / sqrt(head_dim)" in msg
    # block size 4 hard-coded: the notebook's cases pass (all block_size 4), a hidden one with block_size 1 fails
    four = lambda q, c, b, n: _attend(q, c, b, n, bs=4)  # noqa: E731
    assert parts.get("paged_attention").check(four, False) == 3
    msg = failure("paged_attention", four)
    assert "a hidden case" in msg and "block_size=1" in msg


# ---- the learner's backend in the engine ----------------------------------------------------------------------
def _tiny_tokens(backend):
    engine = LLMEngine("tiny", enable_prefix_caching=False, block_size=4, num_gpu_blocks=40,
                       max_num_batched_tokens=16, attention_backend=backend)
    greedy = SamplingParams(temperature=0, max_tokens=10)
    for i, n in enumerate((10, 23, 5)):  # B's 23-token prompt is cut into chunks: attention with context
        engine.add_request(f"r{i}", list(range(3 + 7 * i, 3 + 7 * i + n)), greedy)
    return {rid: out.outputs[0].token_ids for rid, out in engine.run_to_completion().items()}


def test_the_learner_backend_with_the_reference_functions_gives_the_engines_tokens():
    backend = learner_attention_backend(fallback.slot_mapping, fallback.write_kv, fallback.paged_attention)
    assert backend.get_name() == "LEARNER"
    expected = _tiny_tokens(None)
    assert _tiny_tokens(backend) == expected
    # it really ran the functions: one slot_mapping per request and step, write_kv per layer and step
    assert backend.calls["slot_mapping"] > 0 and backend.calls["write_kv"] > 0
    assert backend.calls["paged_attention"] >= backend.calls["write_kv"]


def test_the_learner_backend_runs_the_learners_code(solved):
    backend = learner_attention_backend(solved["slot_mapping"], solved["write_kv"], solved["paged_attention"])
    assert _tiny_tokens(backend) == _tiny_tokens(None)
    # a wrong paged attention (the causal mask not shifted by the context) changes the tokens
    wrong = learner_attention_backend(fallback.slot_mapping, fallback.write_kv,
                                      lambda q, c, b, n: _attend(q, c, b, n, mask_shift=False))
    assert _tiny_tokens(wrong) != _tiny_tokens(None)
    # and so does a wrong slot mapping (keys written where attention does not read them)
    off = learner_attention_backend(lambda bt, pos, bs: [bt[p // bs] * bs + (p + 1) % bs for p in pos],
                                    fallback.write_kv, fallback.paged_attention)
    assert _tiny_tokens(off) != _tiny_tokens(None)


def test_the_learner_backend_rejects_a_wrong_slot_count():
    backend = learner_attention_backend(lambda bt, pos, bs: [0], fallback.write_kv, fallback.paged_attention)
    with pytest.raises(RuntimeError, match="slot_mapping returned 1 slots for request 0's 10 positions"):
        _tiny_tokens(backend)


# The real model (SmolLM2 through the learner backend equals transformers) is the notebook's job: notebook 03,
# section 7, computes both and asserts them equal under nbval (loading SmolLM2 alone takes about 10 s here).


# ---- the grader on the committed notebooks --------------------------------------------------------------------
def test_the_grader_finds_the_blank_exercises_and_passes_the_solutions():
    out = io.StringIO()
    results = grade.grade(["03"], str(ROOT / "notebooks"), hints=1, out=out)
    assert [(p.name, s) for p, s, _, _ in results] == [(n, "blank") for n in PARTS]
    assert "lesson 03, parts passed: 0 of 4" in out.getvalue()
    out = io.StringIO()
    results = grade.grade(["03"], str(ROOT / "notebooks"), solutions=True, out=out)
    assert [(p.name, s) for p, s, _, _ in results] == [(n, "passed") for n in PARTS], out.getvalue()


def test_every_exercise_cell_of_03_is_a_registered_part():
    found = [c.part for c in cells.exercise_cells(str(BLANK))]
    assert found == list(PARTS)
    for c in cells.exercise_cells(str(BLANK)):
        assert "raise NotImplementedError  # your code here" in c.source


# ---- the picture: block tables as maps from logical to physical blocks ------------------------------------------
def test_the_block_table_map_draws_one_arrow_per_block_table_entry():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from minivllm.course.trace import TracedLLMEngine
    from minivllm.course.viz.block_table_map import block_table_arrows, draw_block_table_map

    engine = TracedLLMEngine("tiny", num_gpu_blocks=24, block_size=4, enable_prefix_caching=False)
    greedy = SamplingParams(temperature=0, max_tokens=6)
    engine.add_request("A", list(range(1, 11)), greedy)
    engine.add_request("B", list(range(20, 26)), greedy)
    engine.run_to_completion()
    record = next(r for r in engine.trace if {"A", "B"} <= set(r.requests))
    fig, ax = plt.subplots()
    arrows = draw_block_table_map(record, 4, ax=ax)
    tables = {rid: r.block_ids for rid, r in record.requests.items()}
    assert arrows == [(rid, i, b) for rid in tables for i, b in enumerate(tables[rid])]
    assert sum(len(t) for t in tables.values()) == len(arrows) >= 3
    assert len([c for c in ax.get_children() if isinstance(c, matplotlib.text.Annotation)]) == len(arrows)
    plt.close(fig)
    assert block_table_arrows(record, ["B"]) == [("B", i, b) for i, b in enumerate(tables["B"])]
    with pytest.raises(KeyError, match="request 'Z' is not in step"):
        block_table_arrows(record, ["Z"])
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        draw_block_table_map(record, 0)


def test_paged_attention_without_the_grouped_query_repeat_gets_the_gqa_hint():
    """A fresh learner's read: the raw einsum size error named no hint."""
    import math

    import torch

    from minivllm.course.exercises import fallback
    from minivllm.course.learner import parts

    def no_repeat(q, kv_cache, block_table, num_computed):
        k, v = fallback.gather_kv(kv_cache, block_table, num_computed + q.shape[0])
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)

    status, msg = parts.run_check(parts.get("paged_attention"), no_repeat)
    assert status == "failed" and "4 query / 2 KV heads" in msg
    assert "repeat each KV head num_heads // num_kv_heads times" in msg
