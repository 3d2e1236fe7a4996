"""``minivllm/course/viz/connector_timeline.py``: the swim lanes of a recorded connector run say which hook did
what for which request in which step, and the picture draws them."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from minivllm import SamplingParams  # noqa: E402
from minivllm.course.buggy_connector import BuggyOffloadConnector  # noqa: E402
from minivllm.course.recording_connector import RecordingConnector  # noqa: E402
from minivllm.course.trace import TracedLLMEngine  # noqa: E402
from minivllm.course.viz.connector_timeline import LANES, connector_lanes, plot_connector_timeline  # noqa: E402
from minivllm.distributed.kv_transfer import KVBlockStore, OffloadConnector  # noqa: E402

PROMPT = list(range(1, 41))


def _run(connector, prompts):
    eng = TracedLLMEngine("tiny", kv_connector=connector, block_size=16, num_gpu_blocks=64)
    for rid, p in prompts.items():
        eng.add_request(rid, p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    eng.run_to_completion(max_steps=100)
    return eng


@pytest.fixture(scope="module")
def runs():
    store = KVBlockStore()
    _run(OffloadConnector(16, store=store), {"A": PROMPT})
    good = _run(RecordingConnector(OffloadConnector(16, store=store)), {"B": PROMPT, "C": [7] * 20})
    store = KVBlockStore()  # a fresh store: the run above saved C's block too
    _run(OffloadConnector(16, store=store), {"A": PROMPT})
    buggy = BuggyOffloadConnector(16, store=store)
    bad = _run(RecordingConnector(buggy), {"B": PROMPT, "C": [7] * 20})
    return good, bad


def test_lanes_of_a_working_connector(runs):
    good, _ = runs
    lanes = connector_lanes(good.trace)
    names = [name for _side, name in LANES]
    assert len(lanes) == len(LANES) and all(len(lane) == len(good.trace) for lane in lanes)
    asked = lanes[names.index("get_num_new_matched_tokens")]
    assert asked[0] == [("B", "+32"), ("C", "+0")] and all(c is None for c in asked[1:])
    loads = lanes[names.index("build_connector_meta: loads")]
    assert loads[0] == [("B", "2 blk")] and all(c == [] for c in loads[1:])  # called every step, loads once
    assert lanes[names.index("start_load_kv")][0] == [("B", "2 blk")]
    finished = lanes[names.index("request_finished")]
    assert sorted(rid for c in finished if c for rid, _ in c) == ["B", "C"]


def test_lanes_of_the_buggy_connector_load_in_every_step(runs):
    _, bad = runs
    lanes = connector_lanes(bad.trace)
    loads = lanes[[name for _s, name in LANES].index("build_connector_meta: loads")]
    assert loads == [[("B", "2 blk")]] * len(bad.trace)


def test_plot_and_errors(runs):
    good, _ = runs
    ax = plot_connector_timeline(good.trace, steps=(0, 3), title="t")
    assert len(ax.patches) > 0 and [t.get_text() for t in ax.get_xticklabels()] == ["0", "1", "2", "3"]
    with pytest.raises(ValueError, match="steps must be"):
        plot_connector_timeline(good.trace, steps=(3, 1))
    plain = TracedLLMEngine("tiny", block_size=16, num_gpu_blocks=64)
    plain.add_request("A", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2))
    plain.run_to_completion(max_steps=10)
    with pytest.raises(ValueError, match="RecordingConnector"):
        connector_lanes(plain.trace)
