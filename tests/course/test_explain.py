"""The animator's "why" line: each reason it gives, on a small run built so that the reason is known by hand.

Every scenario runs the tiny model with 16-token blocks. The expected reason and its numbers are worked out in the
test's comment from the scenario alone; the explanation is read off the recorded trace, so a wrong recording, a
wrong reading or a wrong rule fails here. Two scenarios plug a rule-breaking scheduler in through ``scheduler_cls``
and check that the explanation says that vLLM's rule was broken instead of inventing a reason.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from minivllm import SamplingParams
from minivllm.core.sched.scheduler import Scheduler, SchedulerStep
from minivllm.course.figures import preemption_run
from minivllm.course.trace import SchedulerTrace, TracedLLMEngine
from minivllm.course.viz import QueueAnimator, render_frame_html
from minivllm.course.viz.explain import (
    Reason, event_steps, explain_line, explain_step, next_event, running_at_start, step_changes,
)


def _run(prompts: Dict[str, int], *, steps: int, max_tokens: int = 8, arrive_at: Optional[Dict[str, int]] = None,
         priority: Optional[Dict[str, int]] = None, **engine_kwargs) -> SchedulerTrace:
    """Requests ``name -> prompt length`` (random tokens), each added at step ``arrive_at[name]`` (default 0),
    stepped ``steps`` times."""
    eng = TracedLLMEngine("tiny", **engine_kwargs)
    rng = np.random.default_rng(0)
    pending = dict(prompts)
    for k in range(steps):
        for name, n in list(pending.items()):
            if (arrive_at or {}).get(name, 0) <= k:
                eng.add_request(name, {"prompt_token_ids": rng.integers(3, 500, n).tolist()},
                                SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                                priority=(priority or {}).get(name))
                del pending[name]
        eng.step()
    return eng.trace


def _of(reasons: List[Reason], kind: str) -> List[Reason]:
    return [r for r in reasons if r.kind == kind]


def test_budget():
    # 32 + 32 tokens spend the 64-token budget: C, next in line, is not admitted at step 0
    t = _run({"A": 32, "B": 32, "C": 32}, steps=2, max_num_batched_tokens=64, num_gpu_blocks=32)
    r = explain_step(t, 0)
    assert [(x.kind, x.request_id) for x in r] == [("admitted", "A"), ("admitted", "B"), ("not_admitted", "C")]
    assert r[2].cause == "budget" and "64 of 64 tokens" in r[2].text
    assert "64 budget tokens left" in r[0].text and "32 budget tokens left" in r[1].text
    # step 1: A and B decode one token each, C fits the 62 left
    assert [(x.kind, x.request_id) for x in explain_step(t, 1)] == [("admitted", "C")]
    assert "62 budget tokens left" in explain_step(t, 1)[0].text


def test_max_num_seqs():
    t = _run({"A": 8, "B": 8}, steps=2, max_num_seqs=1, num_gpu_blocks=8)
    for k in (0, 1):
        head = _of(explain_step(t, k), "not_admitted")
        assert [(x.request_id, x.cause) for x in head] == [("B", "max_num_seqs")]
        assert "1 is running, max_num_seqs = 1" in head[0].text


def test_no_chunking_is_a_budget_stop():
    # without chunked prefill B's 40 tokens are not cut to the 64 - 40 = 24 left
    t = _run({"A": 40, "B": 40}, steps=2, max_num_batched_tokens=64, max_model_len=64, num_gpu_blocks=16,
             enable_chunked_prefill=False)
    head = _of(explain_step(t, 0), "not_admitted")
    assert [(x.request_id, x.cause) for x in head] == [("B", "no_chunking")]
    assert "40 tokens" in head[0].text and "24 budget tokens left" in head[0].text


def test_whole_prompt_check():
    # 4 blocks; A (20 tokens) gets a 16-token chunk (long_prefill_token_threshold=16) in 1 block; B's whole
    # 60-token prompt needs 4 blocks with 3 free, though its first 16-token chunk would need only 1
    t = _run({"A": 20, "B": 60}, steps=1, max_num_batched_tokens=64, num_gpu_blocks=4,
             long_prefill_token_threshold=16)
    head = t[0].waiting_head
    assert head is not None and head.request_id == "B"
    assert (head.num_new_tokens, head.blocks_for_chunk, head.blocks_for_whole) == (16, 1, 4)
    assert t[0].num_free_blocks == 3
    r = _of(explain_step(t, 0), "not_admitted")
    assert [(x.request_id, x.cause) for x in r] == [("B", "whole_prompt")]
    assert "wants 4 free blocks for all its 60 tokens and 3 are free" in r[0].text and "first chunk of 16 tokens" in r[0].text


def test_blocks():
    # the same without the whole-prompt check, 4 blocks: A takes 2, B's first chunk (the 44 tokens left of the
    # budget) needs 3 and 2 are free
    t = _run({"A": 20, "B": 60}, steps=1, max_num_batched_tokens=64, num_gpu_blocks=4,
             scheduler_reserve_full_isl=False)
    r = _of(explain_step(t, 0), "not_admitted")
    assert [(x.request_id, x.cause) for x in r] == [("B", "blocks")]
    assert "next 44 tokens need 3 KV blocks and 2 are free" in r[0].text


def _fcfs_preemption(**engine_kwargs) -> SchedulerTrace:
    # 3 blocks, three 16-token prompts fill one each; D waits (max_num_seqs=3). At step 1 each decode needs a second
    # block: A preempts C (the last) and takes its block, then B, now the last, preempts itself.
    return _run({"A": 16, "B": 16, "C": 16, "D": 16}, steps=3, max_num_batched_tokens=64, num_gpu_blocks=3,
                max_num_seqs=3, **engine_kwargs)


def test_fcfs_victim_and_the_gate():
    t = _fcfs_preemption()
    assert t[1].preempted == ["B", "C"]
    assert running_at_start(t, 1) == ["A", "B", "C"]
    r = explain_step(t, 1)
    assert [(x.kind, x.request_id, x.cause) for x in r] == [
        ("preempted", "C", "fcfs_last"), ("preempted", "B", "fcfs_last"), ("gate", None, "preemption")]
    assert "last request of the running queue (A B C)" in r[0].text
    assert "last request of the running queue (A B)" in r[1].text
    assert "A got block 2" in r[0].text  # A's new block is the one C held
    assert "D keeps waiting" in r[2].text
    assert "does not run" not in explain_line(t, 0) and "gate" in explain_line(t, 1)


def test_priority_victim_is_the_worst_not_the_last():
    # B (priority 5) runs first; A (0) joins at step 1, C (1) waits for a block. At step 2 A needs a second block:
    # the priority policy preempts B, the worst, though A is the last of the running queue (FCFS would take A)
    t = _run({"B": 16, "A": 16, "C": 16}, steps=3, arrive_at={"A": 1, "C": 1}, priority={"A": 0, "B": 5, "C": 1},
             scheduling_policy="priority", max_num_batched_tokens=64, num_gpu_blocks=3)
    assert running_at_start(t, 2) == ["B", "A"] and t[2].preempted == ["B"]
    r = explain_step(t, 2)
    assert [(x.kind, x.request_id, x.cause) for x in r] == [
        ("preempted", "B", "priority_worst"), ("gate", None, "preemption")]
    assert "priorities: B 5, A 0" in r[0].text
    assert "C keeps waiting" in r[1].text


class _PreemptsTheFirst(Scheduler):
    """FCFS that preempts the first running request: not vLLM's rule."""

    def _pick_victim(self):
        return self.running[0]


class _NoGate(Scheduler):
    """Admits even in a step that preempted: the gate turned off."""

    def _admission_gate_open(self, step: SchedulerStep) -> bool:
        return True


def test_a_broken_victim_rule_is_named_not_explained_away():
    t = _fcfs_preemption(scheduler_cls=_PreemptsTheFirst)
    k = event_steps(t, "preemption")[0]
    causes = [x.cause for x in _of(explain_step(t, k), "preempted")]
    assert "not_last" in causes


def _priority_gate(**engine_kwargs) -> SchedulerTrace:
    # 3 blocks: A (priority 0, 16 tokens) and B (priority 5, 32 tokens) fill them at step 0. At step 1 A needs a
    # second block and preempts B (the worst), which frees 2; A takes 1. D (priority 1, 8 tokens) arrived for step
    # 1 and heads the priority queue, before B: its 1 block is free, only the gate keeps it out.
    return _run({"A": 16, "B": 32, "D": 8}, steps=3, arrive_at={"D": 1}, priority={"A": 0, "B": 5, "D": 1},
                scheduling_policy="priority", max_num_batched_tokens=64, num_gpu_blocks=3, **engine_kwargs)


def test_the_gate_keeps_out_a_request_that_fits():
    t = _priority_gate()
    assert t[1].preempted == ["B"] and t[1].new == [] and t[1].num_free_blocks == 1
    assert t[1].waiting_head is not None and t[1].waiting_head.request_id == "D"
    r = explain_step(t, 1)
    assert [(x.kind, x.cause) for x in r] == [("preempted", "priority_worst"), ("gate", "preemption")]
    assert "D keep waiting" not in r[1].text and "B D keep waiting" not in r[1].text and "D keeps waiting" in r[1].text
    assert t[2].new == ["D"]  # the next step admits it


def test_a_gate_left_open_is_named():
    t = _priority_gate(scheduler_cls=_NoGate)
    assert t[1].preempted == ["B"] and t[1].new == ["D"]
    assert [x.cause for x in _of(explain_step(t, 1), "gate")] == ["open_despite_preemption"]


def test_the_reference_scheduler_is_always_explained():
    """On the course's preemption run no stop of the waiting loop is left unexplained, and the counts match the
    run's recorded facts (tests/course/test_viz.py pins the run: request 3 preempted at step 4)."""
    t = preemption_run().trace
    causes = {}
    for k in range(len(t)):
        for x in explain_step(t, k):
            causes.setdefault((x.kind, x.cause), []).append(k)
    assert ("not_admitted", "unexplained") not in causes
    assert causes[("preempted", "fcfs_last")] == [4] and causes[("gate", "preemption")] == [4]
    assert set(causes) >= {("not_admitted", "budget"), ("not_admitted", "max_num_seqs"),
                           ("not_admitted", "whole_prompt"), ("admitted", ""), ("resumed", ""), ("finished", "")}
    assert causes[("resumed", "")] == [8]  # request 3 comes back at step 8 (tests/course/test_viz.py)
    assert len(causes[("finished", "")]) == 6


def test_events_and_changes():
    t = preemption_run().trace
    assert event_steps(t, "preemption") == [4]
    assert next_event(t, 0, "preemption") == 4 and next_event(t, 4, "preemption") is None
    finishes = event_steps(t, "finish")
    assert len(finishes) == 6 and next_event(t, finishes[0], "finish") == finishes[1]
    with pytest.raises(ValueError, match="kind must be one of"):
        event_steps(t, "eviction")
    c = step_changes(t, 4)
    assert c.moved == {"3": ("running", "waiting")}
    # 3's blocks went back to the pool, one of them to request 2 at once (block 11)
    assert set(c.blocks_freed) | set(c.blocks_taken) >= set(t[3].requests["3"].block_ids)
    assert 11 in c.blocks_taken and t[4].block_owners[11] == ["2"]
    assert step_changes(t, 0).moved == {} and step_changes(t, 0).blocks_taken == []


def test_frame_shows_why_next_events_changes_and_block_table():
    t = preemption_run().trace
    html = render_frame_html(t, 4, selected="2")
    assert 'data-reason="preempted" data-cause="fcfs_last" data-request-id="3"' in html
    assert 'data-reason="gate" data-cause="preemption"' in html
    assert 'data-next="preemption" data-step=""' in html and 'data-next="admission" data-step="8"' in html
    assert 'data-request-id="3" data-queue="waiting"' in html and 'data-changed="running-waiting"' in html
    assert 'data-block="11" data-owner="2" data-cached="0" data-change="taken"' in html
    # request 2's block table: its blocks in order, the last one new in this step, tokens written per block
    table = html.split('class="mv-table"')[1]
    blocks = t[4].requests["2"].block_ids
    assert blocks[-1] == 11
    for i, b in enumerate(blocks):
        assert f'data-logical="{i}" data-block="{b}" data-new="{int(b == 11)}"' in table
    assert table.count("16/16") == 3 and "1/16" in table  # 49 tokens written: 3 full blocks and 1 token
    plain = render_frame_html(t, 4, explain=False, changes=False, with_css=False)
    assert "mv-why" not in plain and "data-changed" not in plain and "mv-table" not in plain
    with pytest.raises(ValueError, match="selected must be"):
        render_frame_html(t, 4, selected="nobody")


def test_animator_buttons_and_block_table():
    t = preemption_run().trace
    a = QueueAnimator(t)
    assert a.selected == "3"  # the first preempted request by default
    assert [b.description for b in a.buttons.values()] == ["next preemption", "next admission", "next finish"]
    assert not a.buttons["preemption"].disabled
    a.buttons["preemption"].click()
    assert a.step == 4 and a.stack.selected_index == 4
    assert a.buttons["preemption"].disabled  # none after step 4
    assert a.jump("preemption") is None and a.step == 4
    a.buttons["admission"].click()
    assert a.step == 8
    a.buttons["finish"].click()
    assert a.step == event_steps(t, "finish")[1]
    a.selected = "2"
    assert 'class="mv-table" data-request-id="2"' in a.stack.children[4].value
    assert a.stack.children[4].value == render_frame_html(t, 4, with_css=False, selected="2")
    a.selected = None
    assert "mv-table" not in a.stack.children[4].value
    with pytest.raises(ValueError, match="selected must be"):
        a.selected = "nobody"
    with pytest.raises(ValueError, match="selected must be"):
        QueueAnimator(t, selected="nobody")
    # the old call still works and the old frame is one switch away
    old = QueueAnimator(t, explain=False, changes=False, selected=None)
    assert "mv-why" not in old.frames[4] and "mv-table" not in old.frames[4]


class _PreemptsTheBest(Scheduler):
    """Priority policy that preempts the most urgent running request: not vLLM's rule."""

    def _pick_victim(self):
        return min(self.running, key=lambda r: (r.priority, r.arrival_time))


def test_a_broken_priority_rule_is_named():
    # the priority scenario above: A (priority 0) needs a block at step 2 and, with this rule, preempts itself
    t = _run({"B": 16, "A": 16, "C": 16}, steps=3, arrive_at={"A": 1, "C": 1}, priority={"A": 0, "B": 5, "C": 1},
             scheduling_policy="priority", max_num_batched_tokens=64, num_gpu_blocks=3, scheduler_cls=_PreemptsTheBest)
    assert t[2].preempted == ["A"]
    r = _of(explain_step(t, 2), "preempted")
    assert [(x.request_id, x.cause) for x in r] == [("A", "not_worst")]
    assert "(B 5, A 0) was B" in r[0].text
