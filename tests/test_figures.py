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


def test_one_figure_from_a_real_run(tmp_path):
    assert figures.main(["--only", "queue_frame_preemption.png", "--out", str(tmp_path)]) == 0
    png = (tmp_path / "queue_frame_preemption.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_preemption_run_is_the_documented_one():
    trace = figures.preemption_run().trace
    assert trace.preemptions() == [(4, "3")]
    assert len(trace) == 47
