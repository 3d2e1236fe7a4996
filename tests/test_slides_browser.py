"""The exported lecture slides in headless Chromium, offline: advance a few slides, find the queue animator, press
Play and watch the frame change. No kernel runs: the animator plays from the widget state saved in the notebook.

The slides are exported here (``minivllm.course.slides.export``, as ``./course.sh slides`` does) into a temporary
folder and opened from ``file://``. Needs Debian's Chromium, pip's ``playwright`` and the npm packages
(``npm ci``; ``./course.sh test`` runs it); without them the test is skipped and says why.
"""

from __future__ import annotations

import os
import shutil

import pytest

from minivllm.course import slides

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]

pytestmark = [
    pytest.mark.skipif(not os.path.exists(CHROMIUM),
                       reason=f"{CHROMIUM} not found: `sudo apt-get install chromium` (./course.sh test does as root)"),
    pytest.mark.skipif(not (slides.ROOT / "node_modules" / "reveal.js").is_dir(),
                       reason="node_modules/ missing: run `npm ci` in the repository root (./course.sh test does)"),
    pytest.mark.timeout(240),
]

# the visible frame of the animator on the current slide: its step and queues
VISIBLE_FRAME = """() => {
    const slide = Reveal.getCurrentSlide();
    const f = [...slide.querySelectorAll('.mv-frame')].find(e => e.getClientRects().length > 0);
    if (!f) return null;
    const q = name => [...f.querySelectorAll(`.mv-req[data-queue="${name}"]`)].map(e => e.dataset.requestId);
    return {step: Number(f.dataset.step), waiting: q('waiting'), running: q('running')};
}"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("slides")
    written = slides.export(out)
    assert sorted(written) == sorted(slides.SLIDE_NOTEBOOKS)
    return out, written


def test_every_deck_is_offline(exported):
    out, written = exported
    for stem, f in written.items():
        page = f.read_text(encoding="utf-8")
        assert slides.check_offline(page) == [], stem
        assert 'src="lib/require.js"' in page and "lib/reveal.js/dist/reveal.css" in page
        assert page.count('<section') >= 10, stem  # the slide metadata reached the exporter
    assert (out / "@jupyter-widgets/html-manager/dist/embed-amd.js").is_file()
    index = (out / "index.html").read_text()
    assert all(f'href="{f.name}"' in index for f in written.values())


def test_animator_plays_in_the_exported_slides(exported):
    playwright = pytest.importorskip("playwright.sync_api", reason="pip install playwright (no browser download)")
    out, written = exported
    deck = written["06_preemption"]
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.set_default_timeout(60_000)
            remote, failed, errors = [], [], []
            page.on("request", lambda r: remote.append(r.url) if not r.url.startswith(("file:", "data:")) else None)
            page.on("requestfailed", lambda r: failed.append(r.url))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(deck.as_uri())
            page.wait_for_function("() => window.Reveal && Reveal.isReady()")
            assert page.evaluate("Reveal.getIndices().h") == 0
            # advance with the keyboard, as a lecturer does, until the current slide shows the animator
            presses = 0
            while not page.evaluate("() => !!Reveal.getCurrentSlide().querySelector('.widget-play')"):
                assert presses < 40, "no slide with the queue animator within 40 key presses"
                page.keyboard.press("Space")
                presses += 1
                page.wait_for_timeout(100)
            assert presses >= 3
            page.wait_for_selector(".mv-frame", state="attached")
            page.wait_for_function(f"() => ({VISIBLE_FRAME})() !== null")
            first = page.evaluate(VISIBLE_FRAME)
            # Play: the notebook starts the animator one step before the first preemption
            play = page.evaluate("() => { const b = Reveal.getCurrentSlide().querySelector('.widget-play button');"
                                 " b.click(); return true; }")
            assert play
            page.wait_for_function(f"() => {{ const f = ({VISIBLE_FRAME})(); return f && f.step >= {first['step'] + 3}; }}",
                                   timeout=30_000)
            later = page.evaluate(VISIBLE_FRAME)
            assert later["step"] > first["step"]
            assert (later["waiting"], later["running"]) != (first["waiting"], first["running"])
            readout = page.evaluate("() => Reveal.getCurrentSlide().querySelector('.widget-readout').innerText")
            assert int(readout) >= later["step"]
            assert remote == [], f"the slides went to the network: {remote[:5]}"
            assert failed == [], f"files missing from the export: {failed[:5]}"
            assert errors == [], errors[:5]
        finally:
            browser.close()


def test_export_needs_the_npm_packages(tmp_path):
    with pytest.raises(FileNotFoundError, match="npm ci"):
        slides.export(tmp_path / "out", names=["06_preemption"], node_modules=tmp_path / "none")
    assert not (tmp_path / "out" / "06_preemption.slides.html").exists()
    shutil.rmtree(tmp_path / "out", ignore_errors=True)
