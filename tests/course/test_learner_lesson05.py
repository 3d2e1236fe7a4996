"""Lesson 05's engine parts (issue 26): chunk sizing (a ``scheduler_cls`` part) and one step's flattened batch
(the model runner's ``_prepare_inputs``). The solutions notebook's cells pass, hidden cases included; the blank
notebook's cells are "blank"; known wrong answers fail with a message naming the difference; the learner's batch
runs inside the engine and gives the reference's greedy tokens."""

from __future__ import annotations

import os

import pytest

from minivllm.course.learner import cells, grade, lesson05, parts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLANK = os.path.join(ROOT, "notebooks", "05_chunked_prefill.ipynb")
SOLUTIONS = os.path.join(ROOT, "notebooks", "solutions", "05_chunked_prefill_solutions.ipynb")


def _source(path, part):
    (cell,) = [c for c in cells.exercise_cells(path) if c.part == part]
    return cell.source


def _define(source, symbol):
    ns = {"__name__": "__test__"}
    exec(compile(source, "<exercise>", "exec"), ns)  # noqa: S102 - the notebook's own exercise cell
    return ns[symbol]


def _variant(part, old, new, symbol):
    """The solution cell of ``part`` with ``old`` replaced by ``new`` (asserted to occur: a wrong variant that
    does not differ from the solution would test nothing)."""
    src = _source(SOLUTIONS, part)
    assert src.count(old) == 1, (part, old)
    return _define(src.replace(old, new), symbol)


# ----------------------------------------------------------------------------------------------- the solutions
@pytest.mark.parametrize("part,symbol", [("chunk_sizing", "ChunkSizing"), ("flattened_batch", "flatten_batch")])
def test_solution_passes_with_hidden_cases(part, symbol):
    status, msg = parts.run_check(parts.get(part), _define(_source(SOLUTIONS, part), symbol), hidden=True)
    assert status == "passed", msg
    n = int(msg.split()[0])
    assert n > (len(lesson05.chunk_sizing_workloads()) if part == "chunk_sizing" else len(lesson05.notebook_batch_cases()))


@pytest.mark.parametrize("part,symbol", [("chunk_sizing", "ChunkSizing"), ("flattened_batch", "flatten_batch")])
def test_blank_cell_is_blank(part, symbol):
    status, msg = parts.run_check(parts.get(part), _define(_source(BLANK, part), symbol))
    assert status == "blank", msg


def test_grader_reads_both_notebooks():
    import io

    out = io.StringIO()
    res = {p.name: s for p, s, _m, _t in grade.grade(["05"], os.path.join(ROOT, "notebooks"), out=out)}
    assert res == {"chunk_sizing": "blank", "flattened_batch": "blank"}, out.getvalue()
    out = io.StringIO()
    res = {p.name: s for p, s, _m, _t in grade.grade(["05"], os.path.join(ROOT, "notebooks"), solutions=True,
                                                         out=out)}
    assert res == {"chunk_sizing": "passed", "flattened_batch": "passed"}, out.getvalue()
    assert "lesson 05, parts passed: 2 of 2" in out.getvalue()


def test_references_are_what_the_engine_runs_while_blank(capsys):
    from minivllm.core.sched.scheduler import Scheduler

    ref = parts.get("chunk_sizing").reference
    assert issubclass(ref, Scheduler) and not [k for k in vars(ref) if callable(vars(ref)[k])]
    assert parts.yours_or_reference("chunk_sizing", _define(_source(BLANK, "chunk_sizing"), "ChunkSizing")) is ref
    part = parts.get("flattened_batch")
    assert parts.run_check(part, part.reference)[0] == "passed"
    assert parts.yours_or_reference("flattened_batch", None) is lesson05.reference_flatten_batch
    assert "runs the reference part" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------- chunk sizing, wrong
def _fails(part, obj):
    status, msg = parts.run_check(parts.get(part), obj)
    assert status == "failed", msg
    return msg


def test_threshold_ignored_fails_on_the_notebooks_threshold_workload():
    cls = _variant("chunk_sizing", "        if 0 < step.long_prefill_token_threshold < num_new_tokens:\n"
                   "            num_new_tokens = step.long_prefill_token_threshold\n"
                   "        num_new_tokens = min(num_new_tokens, step.token_budget)",
                   "        num_new_tokens = min(num_new_tokens, step.token_budget)", "ChunkSizing")
    msg = _fails("chunk_sizing", cls)
    assert "threshold 48 with a neighbour" in msg and "field num_scheduled_tokens, request A" in msg
    assert '"A": 48' in msg and '"A": 64' in msg  # the reference's 48, yours 64, side by side


def test_lone_request_rule_missing_fails_on_the_hidden_lone_request():
    cls = _variant("chunk_sizing", "        if len(self.running) + len(self.waiting) <= 1:\n            return 0\n", "",
                   "ChunkSizing")
    msg = _fails("chunk_sizing", cls)
    assert "hidden: lone request under a threshold" in msg and "step 0, field num_scheduled_tokens, request A" in msg
    assert '{"A": 32}' in msg and '{"A": 8}' in msg


def test_prompt_instead_of_num_tokens_fails_on_resumed_requests():
    cls = _variant("chunk_sizing", "num_new_tokens = request.num_tokens - num_computed_tokens",
                   "num_new_tokens = request.num_prompt_tokens - num_computed_tokens", "ChunkSizing")
    msg = _fails("chunk_sizing", cls)
    assert "resumed" in msg and "field num_scheduled_tokens" in msg
    assert "was resumed after a preemption: its chunk counts from request.num_tokens" in msg


def test_chunking_off_rule_missing_fails_on_chunked_prefill_off():
    cls = _variant("chunk_sizing", "        if not self.config.enable_chunked_prefill and num_new_tokens > "
                   "step.token_budget:\n            return None\n", "", "ChunkSizing")
    msg = _fails("chunk_sizing", cls)
    # D (4 tokens) does not fit the 2 left after C: the reference stops, yours cuts D's prompt to 2 tokens
    assert "enable_chunked_prefill=False" in msg and "step 1, field num_scheduled_tokens, request D" in msg
    assert '"D": 2' in msg


def test_zero_instead_of_none_is_told_to_return_none():
    cls = _variant("chunk_sizing", "        if not self.config.enable_chunked_prefill and num_new_tokens > "
                   "step.token_budget:\n            return None\n",
                   "        if not self.config.enable_chunked_prefill and num_new_tokens > "
                   "step.token_budget:\n            return 0\n", "ChunkSizing")
    msg = _fails("chunk_sizing", cls)
    assert "was admitted with 0 tokens" in msg and "returns None from _num_new_tokens_waiting" in msg


def test_overriding_another_parts_method_fails():
    cls = _define(_source(SOLUTIONS, "chunk_sizing"), "ChunkSizing")
    stray = type("Stray", (cls,), {"_pick_victim": lambda self: self.running[-1],
                                   **{m: vars(cls)[m] for m in lesson05.CHUNK_SIZING_METHODS}})
    assert "_pick_victim, another part's method" in _fails("chunk_sizing", stray)


# -------------------------------------------------------------------------------------- flattened batch, wrong
def test_positions_not_offset_by_num_computed_fail():
    fn = _variant("flattened_batch", "for p in range(context, context + n):", "for p in range(n):", "flatten_batch")
    msg = _fails("flattened_batch", fn)
    assert "160 at 64, step 1" in msg and "field positions, request rhine, its row 0" in msg
    assert "expected 64, yours 0" in msg


def test_logits_at_the_first_row_of_each_request_fail():
    fn = _variant("flattened_batch", "logits_indices.append(query_start_loc[-1] - 1)",
                  "logits_indices.append(query_start_loc[-2])", "flatten_batch")
    msg = _fails("flattened_batch", fn)
    assert "160 at 64, step 0" in msg and "field logits_indices, request rhine: expected 63, yours 0" in msg
    assert "each request's last row: query_start_loc[i + 1] - 1" in msg


def test_slot_equal_to_position_fails_where_blocks_are_not_consecutive():
    fn = _variant("flattened_batch", "slot_mapping.append(table[p // block_size] * block_size + p % block_size)",
                  "slot_mapping.append(p)", "flatten_batch")
    msg = _fails("flattened_batch", fn)
    # the lone 160-token prompt holds blocks 0, 1, 2, ... (slot == position there); the mixed run does not
    assert "two decoders and a long prompt" in msg and "field slot_mapping" in msg


def test_query_start_loc_without_the_leading_zero_fails():
    solution = _define(_source(SOLUTIONS, "flattened_batch"), "flatten_batch")

    def no_zero(*a):
        out = solution(*a)
        return {**out, "query_start_loc": out["query_start_loc"][1:]}

    msg = _fails("flattened_batch", no_zero)
    assert "field query_start_loc, entry 0 (where request rhine starts): expected 0, yours 64" in msg


# ------------------------------------------------------------------------------------------- in the engine
def _tiny_tokens(flatten=None, **engine_kwargs):
    from minivllm import LLMEngine, SamplingParams

    eng = LLMEngine("tiny", block_size=4, num_gpu_blocks=40, max_num_batched_tokens=16, enable_prefix_caching=False,
                    **engine_kwargs)
    if flatten is not None:
        lesson05.use_flatten_batch(eng, flatten)
    for i, n in enumerate((23, 9, 14)):
        eng.add_request(f"r{i}", [5 + (7 * i + j) % 300 for j in range(n)],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    return {rid: o.outputs[0].token_ids for rid, o in eng.run_to_completion().items()}


def test_the_learners_batch_runs_in_the_engine():
    reference = _tiny_tokens()
    assert _tiny_tokens(_define(_source(SOLUTIONS, "flattened_batch"), "flatten_batch")) == reference
    # the engine really uses it: a batch with wrong positions gives other tokens
    wrong = _variant("flattened_batch", "for p in range(context, context + n):",
                     "for p in range(context, context + n):\n            p = p - context", "flatten_batch")
    assert _tiny_tokens(wrong) != reference


@pytest.mark.parametrize("engine_kwargs", [{"model_runner": "v2"}, {"async_scheduling": True}],
                         ids=["model-runner-v2", "async-scheduling"])
def test_the_learners_batch_runs_under_both_runners_and_async(engine_kwargs):
    solution = _define(_source(SOLUTIONS, "flattened_batch"), "flatten_batch")
    assert _tiny_tokens(solution, **engine_kwargs) == _tiny_tokens(**engine_kwargs)


def test_the_engine_refuses_a_batch_that_does_not_fit_the_step():
    def short(*a):
        out = lesson05.reference_flatten_batch(*a)
        return {**out, "positions": out["positions"][:-1]}

    with pytest.raises(ValueError, match="positions must have"):
        _tiny_tokens(short)


# ----------------------------------------------------------------------------------------------- the picture
def test_flattened_batch_picture_segments():
    import matplotlib

    matplotlib.use("Agg")
    from minivllm.course.viz.flattened_batch import batch_segments, draw_flattened_batch

    case = [c for c in lesson05.notebook_batch_cases() if c.name.startswith("two decoders")]
    trace = lesson05._traced_run(16, 64, [("fr", 37, 16), ("sea", 38, 16), ("long", 354, 2, 4)], num_gpu_blocks=64)
    step = next(s for s in trace if s.kinds.get("long") == "prefill" and s.num_computed_before["long"] > 0)
    segs = batch_segments(step)
    assert [s["request"] for s in segs] == ["fr", "sea", "long"]
    assert [s["rows"] for s in segs] == [(0, 0), (1, 1), (2, 63)]
    assert segs[2]["positions"] == (62, 123) and [s["discarded"] for s in segs] == [False, False, True]
    assert [s["logits_row"] for s in segs] == [0, 1, 63] and case
    fig = draw_flattened_batch(step, block_size=16)
    assert len(fig.axes) == 3
    with pytest.raises(ValueError, match="no recorded inputs"):
        draw_flattened_batch(trace[0].__class__(**{**trace[0].__dict__, "inputs": None}), block_size=16)
    with pytest.raises(ValueError, match="block_size must be"):
        draw_flattened_batch(step, block_size=0)
