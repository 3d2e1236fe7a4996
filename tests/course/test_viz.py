"""The viz package renders what the engine recorded: queues in order, chunk vs decode, blocks by owner, and an
animator whose frame follows its slider both ways."""

from __future__ import annotations

import os
from html.parser import HTMLParser
from typing import Dict, List

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from minivllm import SamplingParams
from minivllm.course.trace import TracedLLMEngine
from minivllm.course.viz import (
    DECODE, PREEMPTED, PREFILL, WAITING, QueueAnimator, owner_colors, plot_free_blocks, plot_timeline,
    plot_tokens_per_step, render_frame_html, request_latencies, save_frame_png, timeline_states,
)

PROMPT_LENS = [20, 33, 46, 59, 72, 85]
MAX_TOKENS = [8, 11, 14, 17, 20, 23]


@pytest.fixture(scope="module")
def trace():
    """Six requests into 12 blocks of 16 tokens with a 64-token budget: chunked prefill and one preemption."""
    eng = TracedLLMEngine("tiny", num_gpu_blocks=12, max_num_batched_tokens=64, max_num_seqs=4)
    rng = np.random.default_rng(0)
    for n, m in zip(PROMPT_LENS, MAX_TOKENS):
        eng.add_request(None, {"prompt_token_ids": rng.integers(3, 500, n).tolist()},
                        SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
    eng.run_to_completion(max_steps=500)
    return eng.trace


class _Elements(HTMLParser):
    """Every start tag that has data-* attributes, in document order, with its attributes."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.items: List[Dict[str, str]] = []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        d = {k: v or "" for k, v in attrs}
        if any(k.startswith("data-") for k in d):
            d["tag"] = tag
            self.items.append(d)

    def with_class(self, cls: str) -> List[Dict[str, str]]:
        return [d for d in self.items if cls in d.get("class", "").split()]


def _box(html: str, rid: str) -> str:
    """The HTML of request ``rid``'s box (up to the next box)."""
    return html.split(f'class="mv-req" data-request-id="{rid}"')[1].split('class="mv-req"')[0]


def test_run_has_the_events_the_tests_rely_on(trace):
    # 20 + 33 tokens fit the 64-token budget, the third prompt gets the remaining 11 as a first chunk
    assert trace[0].running == ["0", "1", "2"]
    assert trace[0].num_scheduled_tokens == {"0": 20, "1": 33, "2": 11}
    assert trace.preemptions() == [(4, "3")]


@pytest.mark.parametrize("k", [0, 1, 4, 16])
def test_frame_lists_queues_in_order(trace, k):
    els = _Elements(render_frame_html(trace, k))
    boxes = els.with_class("mv-req")
    assert [b["data-request-id"] for b in boxes if b["data-queue"] == "waiting"] == trace[k].waiting
    assert [b["data-request-id"] for b in boxes if b["data-queue"] == "running"] == trace[k].running
    assert els.with_class("mv-frame")[0]["data-step"] == str(k)


def test_preempted_request_is_at_the_front_of_waiting_with_a_badge(trace):
    html = render_frame_html(trace, 4)
    els = _Elements(html)
    waiting = [b["data-request-id"] for b in els.with_class("mv-req") if b["data-queue"] == "waiting"]
    assert waiting == ["3", "4", "5"]
    assert html.count('class="mv-badge mv-preempted"') == 1
    assert 'data-event="preempted" class="mv-ev-preempted">3<' in html


def test_chunk_and_decode_markup(trace):
    s = trace[1]
    assert s.kinds == {"0": "decode", "1": "decode", "2": "prefill", "3": "prefill"}
    els = _Elements(render_frame_html(trace, 1))
    chunks = {}
    for d in els.with_class("mv-chunk"):
        chunks[d["data-kind"], d["data-tokens"]] = d
    assert {(d["data-kind"], d["data-tokens"]) for d in els.with_class("mv-chunk")} == {
        ("decode", "1"), ("prefill", "35"), ("prefill", "27")
    }
    colors = owner_colors(trace)
    boxes = {b["data-request-id"]: b for b in els.with_class("mv-req")}
    assert boxes["2"]["data-kind"] == "prefill" and boxes["2"]["data-tokens"] == "35"
    assert boxes["0"]["data-kind"] == "decode" and boxes["0"]["data-tokens"] == "1"
    # prefill drawn striped, decode drawn solid in the owner's colour
    assert "repeating-linear-gradient" in chunks["prefill", "35"]["style"]
    assert "repeating-linear-gradient" not in chunks["decode", "1"]["style"]
    assert f"background:{colors['0']}" in _Elements(render_frame_html(trace, 1)).with_class("mv-decode")[0]["style"]
    segs = els.with_class("mv-seg")
    assert [(d["data-request-id"], d["data-kind"], d["data-tokens"]) for d in segs] == [
        ("0", "decode", "1"), ("1", "decode", "1"), ("2", "prefill", "35"), ("3", "prefill", "27")
    ]
    assert els.with_class("mv-budget")[0]["data-used"] == "64"


def test_partial_chunk_samples_no_token(trace):
    html = render_frame_html(trace, 0)
    # request 2 got 11 of its 46 prompt tokens: a partial prefill, so no token is sampled for it
    box = _box(html, "2")
    assert "prefill chunk +11" in box and "no token (partial prompt)" in box
    box0 = _box(html, "0")
    assert "prefill chunk +20 &rarr; samples a token" in box0


@pytest.mark.parametrize("k", [0, 3, 4, 16])
def test_block_colours_follow_owners(trace, k):
    colors = owner_colors(trace)
    blocks = _Elements(render_frame_html(trace, k)).with_class("mv-block")
    s = trace[k]
    assert [int(b["data-block"]) for b in blocks] == list(range(s.num_gpu_blocks))
    for b, owners in zip(blocks, s.block_owners):
        assert b["data-owner"].split() == owners
        if owners:
            assert f"background:{colors[owners[0]]}" in b["style"]
        elif int(b["data-block"]) in s.cached_free_blocks:
            assert b["class"] == "mv-block mv-cached" and "style" not in b
        else:
            assert b["class"] == "mv-block mv-free" and "style" not in b
    # the blocks drawn for each running request are exactly its block table
    for rid in s.running:
        drawn = [int(b["data-block"]) for b in blocks if rid in b["data-owner"].split()]
        assert drawn == sorted(s.requests[rid].block_ids)
    assert sum(1 for b in blocks if not b["data-owner"]) == s.num_free_blocks


def test_colours_are_stable_and_distinct(trace):
    colors = owner_colors(trace)
    assert list(colors) == ["0", "1", "2", "3", "4", "5"]
    assert len(set(colors.values())) == 6


def test_animator_steps_forwards_and_backwards(trace):
    a = QueueAnimator(trace, start=2)
    assert len(a.stack.children) == len(trace) == len(a)
    assert a.stack.selected_index == 2 and a.slider.max == len(trace) - 1 and a.play.max == len(trace) - 1
    a.step = 10
    assert a.stack.selected_index == 10 and a.play.value == 10
    a.step = 4  # backwards
    assert a.stack.selected_index == 4
    a.slider.value = 1  # the slider alone drives the frame too
    assert a.stack.selected_index == 1
    assert a.stack.children[4].value == render_frame_html(trace, 4, with_css=False, selected=a.selected)
    assert "<style>" in a.style.value and "<style>" not in a.stack.children[4].value
    # the browser-side link that makes exported HTML animate: slider.value -> stack.selected_index
    js = [link for link in a._links if type(link).__name__ == "DirectionalLink"]
    assert [(link.source[1], link.target[1]) for link in js] == [("value", "selected_index")]
    assert js[0].source[0] is a.slider and js[0].target[0] is a.stack
    assert a._repr_mimebundle_()["text/plain"] == f"QueueAnimator({len(trace)} steps)"


def test_bad_arguments_raise(trace):
    with pytest.raises(ValueError, match="k must be"):
        render_frame_html(trace, len(trace))
    with pytest.raises(ValueError, match="start must be"):
        QueueAnimator(trace, start=-1)
    with pytest.raises(ValueError, match="interval_ms"):
        QueueAnimator(trace, interval_ms=10)
    a = QueueAnimator(trace)
    with pytest.raises(ValueError, match="step must be"):
        a.step = len(trace)
    assert a.step == 0


def test_timeline_states(trace):
    ids, st = timeline_states(trace)
    assert ids == ["0", "1", "2", "3", "4", "5"]
    r3 = st[ids.index("3")]
    assert r3[0] == WAITING and r3[1] == PREFILL and r3[2] == PREFILL and r3[3] == DECODE
    assert r3[4] == PREEMPTED and r3[5] == WAITING
    assert st[ids.index("2"), 0] == PREFILL
    # every scheduled token of the run shows up as a prefill or decode cell, nothing else does
    scheduled = sum(1 for s in trace for _ in s.num_scheduled_tokens)
    assert int(np.isin(st, [PREFILL, DECODE]).sum()) == scheduled


def test_timeline_with_client_side_arrivals(trace):
    ids, st = timeline_states(trace, arrivals={"5": 0, "late": 3})
    assert (st[ids.index("5"), :10] == WAITING).all()
    assert ids[-1] == "late" and (st[-1, 3:] == WAITING).all() and (st[-1, :3] == 0).all()


def test_latencies(trace):
    lat = request_latencies(trace)
    assert [lat[r].num_output_tokens for r in lat] == MAX_TOKENS
    assert lat["0"].ttft_steps == 1 and lat["0"].latency_steps == MAX_TOKENS[0]
    assert lat["2"].first_token == 1  # its prompt took two chunks
    assert all(lat[r].finished == trace.steps_of(r)[-1] for r in lat)
    shifted = request_latencies(trace, arrivals={"5": -10})
    assert shifted["5"].latency_steps == lat["5"].latency_steps + 10


def test_plots_draw_the_trace(trace, tmp_path):
    ax = plot_timeline(trace)
    _, st = timeline_states(trace)
    assert np.array_equal(ax.images[0].get_array(), st)
    ax = plot_free_blocks(trace)
    assert list(ax.lines[0].get_ydata()) == [s.num_free_blocks for s in trace]
    ax = plot_tokens_per_step(trace)
    heights = [p.get_height() for p in ax.patches]
    n = len(trace)
    assert [a + b for a, b in zip(heights[:n], heights[n:])] == [s.total_scheduled for s in trace]
    save_frame_png(trace, 4, tmp_path / "f.png")
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.pyplot as plt

    plt.close("all")
