"""``python -m minivllm figures``: the registry, the command line, and one figure made from a real run."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest

from minivllm.course import figures


def test_registry_lists_the_course_figures(capsys):
    assert figures.main(["--list"]) == 0
    listed = [line.split(":")[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == sorted(figures.FIGURES)
    assert {"queue_frame_preemption.png", "static_vs_continuous.png", "timeline_preemption.png",
            "latency_static_vs_continuous.png"} <= set(listed)


def test_register_rejects_bad_names():
    with pytest.raises(ValueError, match="already registered"):
        figures.register("static_vs_continuous.png")
    with pytest.raises(ValueError, match="bare file name"):
        figures.register("images/x.png")
    with pytest.raises(ValueError, match="bare file name"):
        figures.register("noext")


def test_unknown_figure_is_an_error(tmp_path, capsys):
    assert figures.main(["--only", "nope.png", "--out", str(tmp_path)]) == 2
    assert "unknown figure(s): nope.png" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def _assert_same_pictures(drawn, committed_dir, names, command):
    """Each of ``names`` in ``drawn`` equals the file in ``committed_dir`` (same size, at most 1e-5 of its pixels
    off by more than 32 in a channel)."""
    import numpy as np
    from PIL import Image

    for name in sorted(names):
        ours = np.asarray(Image.open(drawn / name).convert("RGB"), dtype=np.int16)
        committed = np.asarray(Image.open(committed_dir / name).convert("RGB"), dtype=np.int16)
        assert ours.shape == committed.shape, f"{name}: {ours.shape} vs committed {committed.shape}; run {command}"
        # Rendering is deterministic here (unchanged figures come out pixel-identical); a changed line number in
        # a diagram moves about 0.1 % of the pixels, so the bound is far below that.
        changed = (np.abs(ours - committed).max(axis=-1) > 32).mean()
        assert changed < 1e-5, f"{name}: {changed:.3%} of the pixels differ; run {command}"


def test_committed_images_are_what_figures_draws_now(tmp_path):
    """Every figure in images/ equals what ``python -m minivllm figures`` draws from today's engine and code (the
    runs are seeded and greedy, the diagrams read the source's line numbers): a change that moves them without
    regenerating images/ fails here."""
    import shutil

    if shutil.which("dot") is None:
        pytest.skip("the diagrams need Graphviz's dot: apt-get install graphviz")
    assert figures.main(["--out", str(tmp_path)]) == 0
    _assert_same_pictures(tmp_path, figures.DEFAULT_OUT, figures.FIGURES, "python -m minivllm figures")


def test_committed_chinese_images_are_what_figures_draws_now(tmp_path):
    """images/zh-CN/ (the pictures the Chinese edition shows) holds every figure, each equal to what
    ``python -m minivllm figures --lang zh_CN`` draws now: a changed label, translation or line number without
    regenerated Chinese pictures fails here. The language is English again afterwards."""
    import shutil

    from minivllm.i18n import get_language

    if shutil.which("dot") is None:
        pytest.skip("the diagrams need Graphviz's dot: apt-get install graphviz")
    pytest.importorskip("mplfonts", reason="the Chinese figures need the font package mplfonts")
    assert figures.main(["--lang", "zh_CN", "--out", str(tmp_path)]) == 0
    assert get_language() == "en"
    zh = figures.DEFAULT_OUT / figures.ZH_SUBDIR
    assert sorted(p.name for p in zh.iterdir()) == sorted(figures.FIGURES)
    _assert_same_pictures(tmp_path, zh, figures.FIGURES, "python -m minivllm figures --lang zh_CN")
    # the Chinese pictures are not the English ones: their text changed
    import numpy as np
    from PIL import Image

    for name in ("schedule_flowchart.png", "request_state_machine.png", "connector_calls.png"):
        en = np.asarray(Image.open(figures.DEFAULT_OUT / name).convert("RGB"))
        ours = np.asarray(Image.open(zh / name).convert("RGB"))
        assert en.shape != ours.shape or (en != ours).any(), name


def test_preemption_run_is_the_documented_one():
    trace = figures.preemption_run().trace
    assert trace.preemptions() == [(4, "3")]
    assert len(trace) == 47


def test_frame_budget_bar_shows_a_few_decode_tokens_of_a_large_budget():
    # notebook 06's preemption frame: 2 decode tokens of a 2048-token budget were drawn 0.006 units wide (an
    # empty-looking bar); each segment now has a minimum width, and the few tokens are named after them
    import matplotlib.pyplot as plt

    from minivllm import SamplingParams
    from minivllm.course.trace import TracedLLMEngine
    from minivllm.course.viz import draw_frame
    from minivllm.course.viz import frame_image

    eng = TracedLLMEngine("tiny", block_size=4, num_gpu_blocks=9, enable_prefix_caching=False)
    for i, rid in enumerate("ABC"):
        eng.add_request(rid, [10 + 7 * i + j for j in range(8)], SamplingParams(temperature=0, max_tokens=20))
    eng.run_to_completion()
    k = eng.trace.preemptions()[0][0]
    s = eng.trace[k]
    assert 0 < s.total_scheduled < s.token_budget / 100
    ax = draw_frame(eng.trace, k)
    segs = {p.get_gid(): p for p in ax.patches if (p.get_gid() or "").startswith("budget:")}
    assert set(segs) == {f"budget:{r}" for r, n in s.num_scheduled_tokens.items() if n > 0}
    assert all(p.get_width() >= frame_image._MIN_SEG_W for p in segs.values())
    names = ", ".join(f"{r}: {s.kinds[r]} +{n}" for r, n in s.num_scheduled_tokens.items() if n > 0)
    assert names in [t.get_text() for t in ax.texts]
    plt.close(ax.figure)


def test_the_serving_figure_is_drawn_from_the_readme_measurement():
    """``bench_serve_vs_vllm.png`` is redrawn from ``minivllm/bench/serve/measurement_float32.json``; that record
    holds exactly the README's table of the hand run (rate, server, and median (min-max) of output tok/s, p99
    TTFT, p50 ITL, p99 E2EL) and the command printed above it, so the picture and the README cannot disagree."""
    import json
    import re

    readme = (figures.DEFAULT_OUT.parent / "README.md").read_text(encoding="utf-8")
    record = json.loads(figures.SERVE_MEASUREMENT.read_text(encoding="utf-8"))
    start = readme.index(record["command"].split(" --vllm-args")[0])
    block = readme[start:readme.index("```", start)]
    assert " ".join(block.replace("\\\n", " ").split()) == record["command"]
    table = readme.index("| rate (req/s) |", start)
    rows = []
    for line in readme[table:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    assert len(rows) == len(record["summary"]) == 8

    def cell(v):
        return f"{v['median']:.0f} ({v['min']:.0f}-{v['max']:.0f})"

    for row, r in zip(rows, record["summary"]):
        assert row == [f"{r['request_rate']:g}", {"vllm": "vllm serve"}.get(r["target"], r["target"]),
                       cell(r["output_tok_s"]), cell(r["ttft_p99_ms"]), cell(r["itl_p50_ms"]),
                       cell(r["e2el_p99_ms"])]
    assert re.search(r"!\[[^\]]*\]\(images/bench_serve_vs_vllm\.png\)", readme)
