"""Issue 30: under ``set_language("zh_CN")`` the animator, the pictures and the engine errors the notebooks provoke
on purpose are Chinese; under ``"en"`` (the default) they are the English text the notebooks' stored outputs hold.

The run is the preemption run of ``tests/course/test_viz.py`` (``figures.preemption_run``): request 3 is preempted
in step 4, in which 3 of the 64 budget tokens are used.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from minivllm import SamplingParams  # noqa: E402
from minivllm.config import ParallelConfig  # noqa: E402
from minivllm.course import figures  # noqa: E402
from minivllm.course.calls_view import connector_calls_html  # noqa: E402
from minivllm.course.viz import QueueAnimator, explain_line, plot_timeline, render_frame_html  # noqa: E402
from minivllm.course.viz import fonts  # noqa: E402
from minivllm.course.viz.preemption_picture import plot_preemption  # noqa: E402
from minivllm.i18n import get_language, set_language  # noqa: E402

STEP = 4  # the step that preempts request 3


@pytest.fixture(autouse=True)
def english_afterwards():
    """Each test may switch to Chinese; the next test (and every other test file) starts in English with
    matplotlib's own font list."""
    family = list(matplotlib.rcParams["font.family"])
    yield
    set_language("en")
    matplotlib.rcParams["font.family"] = family
    plt.close("all")


@pytest.fixture(scope="module")
def trace():
    tr = figures.preemption_run().trace
    assert tr.preemptions()[0] == (STEP, "3")
    return tr


def test_frame_html_is_chinese_under_zh_and_unchanged_under_en(trace):
    english = render_frame_html(trace, STEP, selected="3")
    set_language("zh_CN")
    chinese = render_frame_html(trace, STEP, selected="3")
    for text in ('第 <span class="mv-step">4</span> 步', "waiting 队列（队首在前）", "running 队列（按准入顺序）",
                 "token 预算：已用 <b>3</b> / 64 个 token", "KV 块池：12 个块中 <b>3</b> 个空闲", "下一次准入",
                 "<b>3</b> 的块表", "解码 +1 &rarr; 采样一个 token", "prompt 59 &middot; 已计算 0 &middot; 输出 2"):
        assert text in chinese, text
    for text in ("waiting queue (front first)", "token budget", "KV block pool", "samples a token"):
        assert text not in chinese, text
    set_language("en")
    # looked up at call time: switching back gives the English frame again, byte for byte
    assert render_frame_html(trace, STEP, selected="3") == english
    for text in ('<b>step <span class="mv-step">4</span></b>', "waiting queue (front first)",
                 "token budget: <b>3</b> / 64 tokens used", "KV block pool: <b>3</b> of 12 blocks free",
                 "block table of <b>3</b>"):
        assert text in english, text


def test_explanation_is_chinese_under_zh(trace):
    english = explain_line(trace, STEP)
    assert english.startswith("3 preempted: a running request needed a new KV block and none was free (2 got block "
                              "11 in this step); FCFS preempts the last request of the running queue (0 1 2 3)")
    set_language("zh_CN")
    assert explain_line(trace, STEP) == (
        "3 被抢占：一个运行中的请求需要新的 KV 块，但已经没有空闲块（本步：2 分到块 11）；FCFS 抢占运行队列（0 1 2 3）"
        "的最后一个请求，也就是最晚到达的那个；waiting 循环没有运行：这一步发生了抢占，vLLM 的 'if not preempted_reqs' "
        "不成立，所以这一步没有请求准入；4 5 继续等待")
    assert explain_line(trace, STEP - 1) == "4 未准入：已有 4 个请求在运行，max_num_seqs = 4"


def test_animator_controls_follow_the_language(trace):
    set_language("zh_CN")
    a = QueueAnimator(trace, selected=None)
    assert a.slider.description == "步" and a.play.description == "播放"
    assert [b.description for b in a.buttons.values()] == ["下一次抢占", "下一次准入", "下一次结束"]
    assert a.buttons["finish"].tooltip == "跳到下一个有请求结束的步"
    assert a.request.description == "块表" and a.request.label == "（无）" and a.selected is None
    a.selected = "3"  # the menu's values stay the request ids and "(none)"
    assert a.selected == "3" and "<b>3</b> 的块表" in a.frames[STEP]
    set_language("en")
    b = QueueAnimator(trace, selected=None)
    assert b.slider.description == "step" and b.request.label == "(none)" and b.request.value == "(none)"
    assert [x.description for x in b.buttons.values()] == ["next preemption", "next admission", "next finish"]


def test_figures_draw_chinese_labels_with_the_cjk_font(trace):
    set_language("zh_CN")
    ax = plot_timeline(trace)
    assert ax.get_title() == "每个请求在每一步做了什么"
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("引擎步", "请求")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["不在引擎中", "等待", "预填充", "解码", "被抢占"]
    assert matplotlib.rcParams["font.family"][-1] == fonts.FONT_NAME
    fig, change = plot_preemption(trace)
    texts = {t.get_text() for a in fig.axes for t in a.texts}
    assert {"第 4 步之前", "第 4 步的 schedule() 之后：抢占了 3", "waiting 队列（队首在前）", "3 释放"} <= texts
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Glyph ... missing from font(s)" would be a UserWarning
        ax.figure.canvas.draw()
        fig.canvas.draw()


def test_chinese_labels_on_axes_made_before_the_font_was_added(trace):
    """A notebook makes its axes (``plt.subplots``) and hands them to the course's plotting functions; the first such
    figure in a Chinese kernel (notebook 04's two timelines) was made before the CJK font was added, and its axis
    labels, whose text objects the axes made then, drew as empty boxes."""
    from minivllm.course.viz.plots import plot_free_blocks

    from minivllm.course.viz.block_table_map import draw_block_table_map

    fig, axes = plt.subplots(1, 3)
    set_language("zh_CN")
    assert fonts.FONT_NAME not in matplotlib.rcParams["font.family"]  # nothing has added it yet in this test
    plot_timeline(trace, axes[0])
    plot_free_blocks(trace, axes[1])
    draw_block_table_map(trace[STEP], 16, ax=axes[2])  # notebook 03: its title is set with loc="left"
    assert (axes[0].get_xlabel(), axes[0].get_ylabel()) == ("引擎步", "请求")
    for ax in axes:
        for text in (ax.title, ax._left_title, ax.xaxis.label, ax.yaxis.label):
            assert text.get_fontfamily()[-1] == fonts.FONT_NAME, text.get_text()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Glyph ... missing from font(s) DejaVu Sans" is a UserWarning
        fig.canvas.draw()


def test_monospaced_chinese_labels_have_the_cjk_font():
    """The hash chain writes 「哈希 <hash>」 in a monospaced font (notebook 07): an explicit family replaces the font
    list, so 哈希 drew as empty boxes until the CJK font came after ``monospace``."""
    from minivllm.course.trace import TracedLLMEngine
    from minivllm.course.viz.hash_chain import draw_hash_chain

    eng = TracedLLMEngine("tiny", block_size=4, num_gpu_blocks=16, max_model_len=64)
    eng.add_request("A", list(range(11, 24)), SamplingParams(temperature=0, max_tokens=2))
    eng.step()
    assert fonts.monospace() == "monospace"
    set_language("zh_CN")
    ax = draw_hash_chain([eng.scheduler.requests["A"]], 4, eng.kv_cache_manager.block_pool)
    hashes = [t for t in ax.texts if t.get_text().startswith("哈希 ")]
    assert len(hashes) == 3 and all(t.get_fontfamily() == ["monospace", fonts.FONT_NAME] for t in hashes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ax.figure.canvas.draw()


def test_axes_a_chinese_notebook_makes_before_drawing_get_the_cjk_font_too(trace):
    """The Chinese notebooks' first cell is ``minivllm.course.set_language("zh_CN")``; later a notebook makes its own
    axes (``fig, ax = plt.subplots()``) and hands them to a course function (notebook 04: ``plot_timeline(trace, ax,
    ...)``). An axes' title and axis labels take their font when the axes are made, so the CJK font must be in
    ``font.family`` from that first cell on, not only from the first course drawing: else 请求/引擎步 are empty boxes."""
    from minivllm.course import set_language as course_set_language

    assert fonts.FONT_NAME not in matplotlib.rcParams["font.family"]
    assert course_set_language("zh_CN") == "zh_CN"
    assert matplotlib.rcParams["font.family"][-1] == fonts.FONT_NAME
    _fig, ax = plt.subplots()
    plot_timeline(trace, ax, title="第 4 步")
    assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) == ("第 4 步", "引擎步", "请求")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Glyph ... missing from font(s) DejaVu Sans" is a UserWarning
        ax.figure.canvas.draw()
    assert course_set_language("en") == "en" and get_language() == "en"


def test_english_figures_keep_matplotlibs_fonts(trace):
    family = list(matplotlib.rcParams["font.family"])
    ax = plot_timeline(trace)
    assert ax.get_title() == "What each request did in each step" and ax.get_xlabel() == "engine step"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["not in engine", "waiting", "prefill chunk", "decode",
                                                              "preempted"]
    assert matplotlib.rcParams["font.family"] == family and fonts.FONT_NAME not in family


def test_a_missing_font_package_is_named_only_in_chinese(monkeypatch):
    monkeypatch.setattr(fonts.importlib.util, "find_spec", lambda name: None)
    fonts.use_language_font()  # English: nothing to load, no error
    set_language("zh_CN")
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps mplfonts"):
        fonts.cjk_font_path()


def test_connector_calls_panel_is_chinese_under_zh():
    calls = [{"call": "save_kv_layer", "layer": i, "side": "worker"} for i in range(2)]
    assert "<b>KV connector calls in step 3</b>" in connector_calls_html(calls, 3)
    set_language("zh_CN")
    html = connector_calls_html(calls, 3)
    assert "<b>第 3 步的 KV connector 调用</b>" in html and "save_kv_layer × 2（每层算完后各一次）" in html
    assert "没有调用" in connector_calls_html([], 0)


SMOLLM2_HEADS = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536)


def test_provoked_engine_errors_are_chinese_under_zh():
    """The errors notebooks 10 and 12 provoke on purpose (their stored outputs hold the English)."""
    from minivllm.engine.llm_engine import LLMEngine

    english = ("num_gpu_blocks (9) x block_size (4) = 36 tokens cannot hold one request of max_model_len (40) tokens: "
               "need at least 10 blocks, or a smaller max_model_len")
    with pytest.raises(ValueError) as e:
        LLMEngine("tiny", block_size=4, num_gpu_blocks=9, max_model_len=40)
    assert str(e.value) == english
    set_language("zh_CN")
    assert get_language() == "zh_CN"
    with pytest.raises(ValueError) as e:
        LLMEngine("tiny", block_size=4, num_gpu_blocks=9, max_model_len=40)
    assert str(e.value) == ("num_gpu_blocks（9）x block_size（4）= 36 个 token，装不下一个 max_model_len（40）个 token "
                            "的请求：至少需要 10 个块，或者调小 max_model_len")
    with pytest.raises(ValueError) as e:
        ParallelConfig(9).verify_with_model_config(SMOLLM2_HEADS)
    assert str(e.value) == ("tensor_parallel_size（9）必须整除模型的 intermediate_size（1536）；这个模型可用的大小："
                            "[1, 3]")
    engine = LLMEngine("tiny", block_size=4, num_gpu_blocks=9, max_model_len=36)
    with pytest.raises(ValueError) as e:
        engine.add_request("huge", list(range(1, 41)), SamplingParams(max_tokens=1))
    assert str(e.value) == ("prompt 有 40 个 token，需要 10 个 KV 块（block_size=4），但整个缓存只有 num_gpu_blocks=9"
                            "（36 个 token）：它永远无法调度")
    assert "huge" not in engine.scheduler.requests


def test_event_labels_take_the_chinese_colon(trace):
    assert '<div class="mv-events">new: <span data-event="new">' in render_frame_html(trace, STEP, selected="3")
    set_language("zh_CN")
    html = render_frame_html(trace, STEP, selected="3")
    assert '<div class="mv-events">新加入： <span data-event="new">' in html and "恢复： <span" in html
    assert "新加入:" not in html and "恢复:" not in html


def test_connector_lane_labels_follow_the_language():
    from minivllm.course.viz.connector_timeline import LANES, connector_lanes

    calls = [{"call": "get_num_new_matched_tokens", "req_id": "B", "result": (32, True)},
             {"call": "update_state_after_alloc", "req_id": "B", "num_external_tokens": 32},
             {"call": "build_connector_meta", "meta": {"load_async": {"B": 2}, "save": {"C": 1}}},
             {"call": "get_finished", "finished_recving": ["B"]}]
    trace = [SimpleNamespace(connector_calls=calls)]
    names = [name for _side, name in LANES]

    def labels():
        lanes = connector_lanes(trace)
        return [lanes[names.index(n)][0] for n in ("get_num_new_matched_tokens", "update_state_after_alloc",
                                                   "build_connector_meta: loads", "build_connector_meta: saves",
                                                   "get_finished")]

    english = labels()
    assert english == [[("B", "+32 async")], [("B", "ext 32")], [("B", "2 blk async")], [("C", "1 blk")],
                       [("B", "loaded")]]
    set_language("zh_CN")
    assert labels() == [[("B", "+32 异步")], [("B", "外部 32")], [("B", "2 块 异步")], [("C", "1 块")],
                        [("B", "已加载")]]
    set_language("en")
    assert labels() == english


def test_roofline_and_serving_plots_are_chinese_under_zh():
    from minivllm.bench.roofline import StepCost, plot_roofline
    from minivllm.bench.serve.plot import plot_latency_vs_rate

    def texts(fig):
        return {t.get_text() for t in fig.findobj(matplotlib.text.Text)}

    point = [("decode, batch 1", StepCost(2e9, 1e9), 0.05)]
    stat = {"median": 10.0, "min": 9.0, "max": 11.0}
    rows = [{"target": "minivllm", "request_rate": r, "ttft_p99_ms": stat, "itl_p50_ms": stat, "e2el_p99_ms": stat,
             "output_tok_s": stat} for r in (4.0, float("inf"))]

    def draw():
        fig, ax = plt.subplots()
        plot_roofline(ax, 50e9, 10e9, point)
        return texts(fig) | {t.get_text() for t in ax.get_legend().get_texts()}, texts(plot_latency_vs_rate(rows))

    roof, serve = draw()
    assert {"roofline (measured)", "ridge: 5 FLOP/byte", "arithmetic intensity (FLOPs per byte from memory)"} <= roof
    assert {"request rate (req/s)", "p99 time to first token (ms)"} <= serve
    set_language("zh_CN")
    roof, serve = draw()
    assert {"roofline（实测）", "拐点：5 FLOP/字节", "算术强度（每从内存读 1 字节做的 FLOP 数）",
            "decode, batch 1"} <= roof
    assert {"请求速率（请求/秒）", "p99 首 token 延迟 TTFT（ms）", "每秒输出 token 数"} <= serve
    assert fonts.FONT_NAME in matplotlib.rcParams["font.family"]
