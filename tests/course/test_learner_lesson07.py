"""Lesson 07's part (issue 26): the prefix-cache lookup at admission, ``PrefixCacheLookup._prefix_cache_lookup``.

The solution passes (hidden cases included); the blank cell is "blank"; the known wrong variants (counting past
the first miss, no last-block rule, ignoring ``skip_reading_prefix_cache``, calling ``get_computed_blocks``,
overriding another part's method) fail with a message that names the difference; the hidden workloads do reach
the states they are there for; the grader finds the exercise cell of the committed notebook blank and passes the
solutions notebook; the hash-chain picture reads the engine's chain.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from minivllm.core.sched.scheduler import PrefixCacheHit, Scheduler
from minivllm.course.learner import lesson07, parts
from minivllm.course.learner.parts import PartFailed

ROOT = Path(__file__).resolve().parents[2]


def _walk(kv, request, stop_at_miss=True, cap=True, skip_rule=True):
    blocks = []
    allowed = kv.prefix_cache_lookup_enabled(request) if skip_rule else kv.enable_caching
    if allowed:
        hashes = request.block_hashes[:(request.num_tokens - 1) // kv.block_size] if cap else request.block_hashes
        for h in hashes:
            block = kv.block_pool.get_cached_block(h)
            if block is None:
                if stop_at_miss:
                    break
                continue
            blocks.append(block)
    return PrefixCacheHit(blocks, len(blocks) * kv.block_size, 0, False)


class Solution(Scheduler):
    def _prefix_cache_lookup(self, request):
        return _walk(self.kv_cache_manager, request)


class PastFirstMiss(Scheduler):
    def _prefix_cache_lookup(self, request):
        return _walk(self.kv_cache_manager, request, stop_at_miss=False)


class NoLastBlockRule(Scheduler):
    def _prefix_cache_lookup(self, request):
        return _walk(self.kv_cache_manager, request, cap=False)


class IgnoresSkipReading(Scheduler):
    def _prefix_cache_lookup(self, request):
        return _walk(self.kv_cache_manager, request, skip_rule=False)


class CallsGetComputedBlocks(Scheduler):
    def _prefix_cache_lookup(self, request):
        blocks, n = self.kv_cache_manager.get_computed_blocks(request)
        return PrefixCacheHit(blocks, n, 0, False)


class CallsSuper(Scheduler):
    def _prefix_cache_lookup(self, request):
        return super()._prefix_cache_lookup(request)


class Blank(Scheduler):
    def _prefix_cache_lookup(self, request):
        raise NotImplementedError


class TouchesBlocks(Scheduler):
    def _prefix_cache_lookup(self, request):
        hit = _walk(self.kv_cache_manager, request)
        self.kv_cache_manager.block_pool.touch(hit.new_computed_blocks)
        return hit


class AlsoSizesChunks(Scheduler):
    def _prefix_cache_lookup(self, request):
        return _walk(self.kv_cache_manager, request)

    def _num_new_tokens_waiting(self, request, num_computed_tokens, step):
        return super()._num_new_tokens_waiting(request, num_computed_tokens, step)


PART = parts.get("prefix_cache_lookup")


def test_registered_with_its_seam_and_reference():
    assert PART.lesson == "07" and PART.symbol == "PrefixCacheLookup" and PART.kind == "scheduler"
    assert PART.reference is lesson07.PrefixCacheLookupReference
    assert not [k for k in vars(PART.reference) if callable(vars(PART.reference)[k])]  # overrides nothing


def test_solution_passes_hidden_cases_included():
    status, msg = parts.run_check(PART, Solution, hidden=True)
    assert status == "passed", msg
    n_visible = PART.check(Solution, False)
    n_hidden = PART.check(Solution, True)
    assert n_hidden > n_visible > len(lesson07.notebook_workloads())


def test_blank_is_blank():
    assert parts.run_check(PART, Blank, hidden=True)[0] == "blank"
    assert parts.run_check(PART, None, hidden=True)[0] == "blank"


def test_counting_past_the_first_miss_fails_naming_it():
    status, msg = parts.run_check(PART, PastFirstMiss, hidden=False)
    assert status == "failed"
    assert "block 3 evicted" in msg and "[True, True, True, False, True]" in msg
    assert "expected: 3 blocks [0, 1, 2]" in msg and "yours:    4 blocks [0, 1, 2, 4]" in msg
    assert "stops at the first miss" in msg


def test_no_last_block_rule_fails_naming_it():
    status, msg = parts.run_check(PART, NoLastBlockRule, hidden=False)
    assert status == "failed"
    assert "a request of 4 tokens (block_size=4, 1 full block)" in msg
    assert "at most (4 - 1) // 4 = 0 blocks" in msg and "yours:    1 block [0]" in msg
    assert "the last-block rule" in msg


def test_ignoring_skip_reading_prefix_cache_fails_naming_it():
    status, msg = parts.run_check(PART, IgnoresSkipReading, hidden=False)
    assert status == "failed"
    assert "skip_reading_prefix_cache=True" in msg and "expected: 0 blocks []" in msg
    assert "prefix_cache_lookup_enabled(request) is False" in msg


@pytest.mark.parametrize("cls", [CallsGetComputedBlocks, CallsSuper])
def test_the_shortcut_fails_by_name(cls):
    status, msg = parts.run_check(PART, cls, hidden=False)
    assert status == "failed" and "called kv_cache_manager.get_computed_blocks" in msg
    assert "block_pool.get_cached_block" in msg


def test_a_lookup_that_takes_references_fails():
    status, msg = parts.run_check(PART, TouchesBlocks, hidden=False)
    assert status == "failed" and "your lookup changed the block pool" in msg


def test_overriding_another_parts_method_fails():
    status, msg = parts.run_check(PART, AlsoSizesChunks, hidden=False)
    assert status == "failed" and "also overrides _num_new_tokens_waiting, another part's method" in msg


@pytest.mark.parametrize("cls, workload, field", [
    (PastFirstMiss, "a miss in the middle (hidden)", "num_scheduled_tokens"),
    (IgnoresSkipReading, "a miss in the middle (hidden)", "num_scheduled_tokens"),
    (IgnoresSkipReading, "skip_reading_prefix_cache (hidden)", "num_scheduled_tokens"),
    (NoLastBlockRule, "07 section 5a: a fully cached prompt of two blocks", "num_scheduled_tokens"),
    (NoLastBlockRule, "full hits of 16 tokens (hidden)", "num_scheduled_tokens"),
])
def test_whole_runs_catch_each_mistake(cls, workload, field):
    """Each wrong variant also differs in a whole engine run, not only in the direct lookups: the step record
    names the step, the field and the request."""
    w = next(w for w in lesson07.notebook_workloads() + lesson07.hidden_workloads() if w["name"] == workload)
    with pytest.raises(PartFailed) as e:
        lesson07._check_workload(cls, w)
    msg = str(e.value)
    assert f"on workload {workload!r}" in msg and f"field {field}" in msg and "side by side" in msg


def test_the_middle_miss_workload_reaches_a_miss_before_cached_blocks():
    """The hidden workload builds, in a real run, the state the checker's direct lookups build by hand."""
    seen = {}

    class Spy(Scheduler):
        def _prefix_cache_lookup(self, request):
            pool = self.kv_cache_manager.block_pool
            seen[request.request_id] = [pool.get_cached_block(h) is not None for h in request.block_hashes]
            return super()._prefix_cache_lookup(request)

    w = lesson07._middle_miss()
    steps = lesson07.compare.run_steps(w, lesson07._harness(Spy, w["skip_reading"]))
    assert seen["C"] == [True, False, True, True]
    assert [s["num_computed_at_admission"].get("C") for s in steps if "C" in s["new"]] == [4]


def test_grader_finds_the_blank_notebook_cell_and_passes_the_solutions(tmp_path):
    from minivllm.course.learner import grade

    out = io.StringIO()
    res = grade.grade(["07"], str(ROOT / "notebooks"), out=out)
    assert [(p.name, s) for p, s, _m, _t in res] == [("prefix_cache_lookup", "blank")]
    out = io.StringIO()
    res = grade.grade(["07"], str(ROOT / "notebooks"), solutions=True, out=out)
    assert [(p.name, s) for p, s, _m, _t in res] == [("prefix_cache_lookup", "passed")], out.getvalue()


def test_hash_chain_rows_follow_the_engine():
    from minivllm import SamplingParams
    from minivllm.course.trace import TracedLLMEngine
    from minivllm.course.viz.hash_chain import draw_hash_chain, hash_chain_rows

    eng = TracedLLMEngine("tiny", block_size=4, num_gpu_blocks=16, max_model_len=64)
    system = list(range(11, 21))
    eng.add_request("A", system + [101, 102, 103], SamplingParams(temperature=0, max_tokens=4))
    eng.step()
    eng.add_request("B", system + [201, 202], SamplingParams(temperature=0, max_tokens=4))
    eng.step()
    reqs = [eng.scheduler.requests[r] for r in "AB"]
    rows = hash_chain_rows(reqs, 4, eng.kv_cache_manager.block_pool)
    a, b = rows["A"], rows["B"]
    assert [x.hash for x in a[:2]] == [x.hash for x in b[:2]] and a[2].hash != b[2].hash
    assert all(x.parent == prev.hash for row in rows.values() for prev, x in zip(row, row[1:]))
    assert [x.cached_block_id for x in b] == eng.kv_cache_manager.get_block_ids("B")[:3]
    assert b[2].tokens == [19, 20, 201, 202]
    with pytest.raises(ValueError, match="block_size 16 is not the engine's"):
        hash_chain_rows(reqs, 16)
    import matplotlib
    matplotlib.use("Agg")
    ax = draw_hash_chain(reqs, 4, eng.kv_cache_manager.block_pool)
    texts = [t.get_text() for t in ax.texts]
    assert f"hash {a[0].hash}" in texts and "block 4" in texts and texts.count(f"hash {a[0].hash}") == 2


def _solution_from_the_solutions_notebook():
    from minivllm.course.learner import cells

    path = str(ROOT / "notebooks" / "solutions" / "07_prefix_caching_solutions.ipynb")
    ns = cells.run_cells(cells.exercise_cells(path), path)
    assert not ns["__errors__"]
    return ns["PrefixCacheLookup"]


@pytest.mark.parametrize("load_mode", ["sync", "async"])
def test_the_given_connector_lines_match_the_reference(load_mode):
    """With a KV connector the learner's class runs its own walk plus the cell's given connector lines (the
    checker's runs have no connector): a fresh engine loading a stored prefix from the CPU store schedules, caches
    and samples exactly as the reference does, synchronous and asynchronous loads alike."""
    from minivllm import SamplingParams
    from minivllm.course.trace import TracedLLMEngine
    from minivllm.distributed.kv_transfer import KVBlockStore, OffloadConnector

    yours = _solution_from_the_solutions_notebook()
    prompt = list(range(30, 52))
    store = KVBlockStore()
    filler = TracedLLMEngine("tiny", block_size=4, num_gpu_blocks=32, max_model_len=64,
                             kv_connector=OffloadConnector(4, store=store))
    filler.add_request("P", prompt, SamplingParams(temperature=0, max_tokens=2))
    filler.run_to_completion()

    def run(cls):
        eng = TracedLLMEngine("tiny", block_size=4, num_gpu_blocks=32, max_model_len=64, scheduler_cls=cls,
                              kv_connector=OffloadConnector(4, store=store, load_mode=load_mode))
        eng.add_request("A", prompt + [7, 8], SamplingParams(temperature=0, max_tokens=3))
        eng.add_request("B", prompt[:9], SamplingParams(temperature=0, max_tokens=3, skip_reading_prefix_cache=True))
        out = eng.run_to_completion()
        return ([s.num_scheduled_tokens for s in eng.trace],
                {r: (o.num_cached_tokens, o.outputs[0].token_ids) for r, o in out.items()})

    ref, got = run(Scheduler), run(yours)
    assert got == ref
    assert ref[1]["A"][0] == 20 and ref[1]["B"][0] == 0  # A loaded 5 stored blocks; B read no cache
