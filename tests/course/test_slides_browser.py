"""The exported lecture slides, every notebook's deck: offline, with the run sheets' speaker notes under the slides
they cite; and in headless Chromium at a projector's 1280x800, offline: advance a few slides, find the queue
animator, check its slides layout is the large one, press Play and watch the frame change. No kernel runs: the
animator plays from the widget state saved in the notebook.

The slides are exported here (``minivllm.course.slides.export``, as ``./course.sh slides`` does) into a temporary
folder and opened from ``file://``. Needs Debian's Chromium, pip's ``playwright`` and the npm packages
(``npm ci``; ``./course.sh test`` runs it); without them the test is skipped and says why.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from minivllm.course import slides
from minivllm.course.viz.frame import FRAME_CSS_SLIDES

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


def screens(page: str) -> int:
    """The screens of an exported deck: its innermost ``<section>`` elements (a slide without subslides, or each of
    a slide's subslides)."""
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(page, "html.parser")
    return sum(1 for s in soup.select("div.slides section") if not s.find("section"))


def test_every_deck_is_offline(exported):
    out, written = exported
    for stem, f in written.items():
        page = f.read_text(encoding="utf-8")
        assert slides.check_offline(page) == [], stem
        assert 'src="lib/require.js"' in page and "lib/reveal.js/dist/reveal.css" in page
        # the rule reached the exporter: as many screens as the rule's parts have slides
        cells = json.loads((slides.NOTEBOOKS_DIR / f"{stem}.ipynb").read_text(encoding="utf-8"))["cells"]
        types = [t for _, _, t in slides.part_slide_types(cells, slides.slide_budget(stem))]
        assert screens(page) == slides.count_slides(types), stem
        assert FRAME_CSS_SLIDES.strip() in page, stem  # the animator's slides layout
    assert (out / "@jupyter-widgets/html-manager/dist/embed-amd.js").is_file()
    index = (out / "index.html").read_text()
    assert all(f'href="{f.name}"' in index for f in written.values())


def _norm(text: str) -> str:
    return " ".join(text.replace("¶", "").split())


def test_speaker_notes_under_the_cited_slides(exported):
    """Every segment of every run sheet is in the speaker notes (``<aside class="notes">``) of the slide that shows
    the first heading it cites in its lecture's notebooks; each deck's title slide has the run sheet's overview."""
    from bs4 import BeautifulSoup

    _, written = exported
    placed = 0
    for stem, items in slides.lecture_notes().items():
        soup = BeautifulSoup(written[stem].read_text(encoding="utf-8"), "html.parser")
        first = soup.select_one("div.slides section")
        first = first.find("section") or first
        assert "Run sheet: Lecture" in first.get_text() and first.select("aside.notes"), stem
        for anchor, text in items:
            m = re.match(r"\*\*Segment (\d+) of \d+", text)
            if anchor is None or not m:
                continue
            if anchor.startswith("[Q"):
                found = [e for e in soup.select("div.jp-CodeCell") if f"# {anchor}" in e.get_text()]
            else:
                found = [h for h in soup.find_all(re.compile("^h[1-6]$"))
                         if _norm(h.get_text()) == anchor.replace("`", "") and not h.find_parent("aside")]
            assert found, f"{stem}: {anchor!r} not on any slide"
            section = found[0].find_parent("section")
            notes = [a.get_text() for a in section.find_all("aside", class_="notes")
                     if a.find_parent("section") is section]
            assert any(f"Segment {m.group(1)} of" in n for n in notes), (stem, anchor)
            placed += 1
    assert placed >= 60  # seven run sheets of about ten segments
    # what a lecturer needs, on the slide where it is needed: lecture 3's Demo 3 with its safe budget-50 cell
    soup = BeautifulSoup(written["05_chunked_prefill"].read_text(encoding="utf-8"), "html.parser")
    h = next(h for h in soup.find_all("h2") if _norm(h.get_text()).startswith("2. What the scheduler does"))
    notes = " ".join(a.get_text() for a in h.find_parent("section").select("aside.notes"))
    assert "[50, 50, 50, 10]" in notes and "AssertionError" in notes and "Misconceptions" in notes


def _decks_with_animator():
    """The notebooks with a shown (not skipped) cell that displays a ``QueueAnimator`` from saved widget state."""
    out = []
    for name in slides.SLIDE_NOTEBOOKS:
        cells = json.loads((slides.NOTEBOOKS_DIR / f"{name}.ipynb").read_text(encoding="utf-8"))["cells"]
        for cell, t in zip(cells, slides.stored_slide_types(cells)):
            outputs = cell.get("outputs", [])
            if t != "skip" and "QueueAnimator(" in "".join(cell["source"]) and any(
                    "application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in outputs):
                out.append(name)
                break
    return out


ANIMATOR_DECKS = _decks_with_animator()


def test_the_animator_is_in_several_decks():
    assert {"00_tour", "04_continuous_batching", "06_preemption", "11_serving"} <= set(ANIMATOR_DECKS)


@pytest.mark.parametrize("stem", ANIMATOR_DECKS)
def test_animator_plays_in_the_exported_slides(exported, stem, tmp_path):
    playwright = pytest.importorskip("playwright.sync_api", reason="pip install playwright (no browser download)")
    out, written = exported
    deck = written[stem]
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
            assert presses >= 1
            page.wait_for_selector(".mv-frame", state="attached")
            page.wait_for_function(f"() => ({VISIBLE_FRAME})() !== null")
            first = page.evaluate(VISIBLE_FRAME)
            # the slides layout: readable from the back of the room at 1280x800 (the notebook's is 13 px)
            size = page.evaluate("""() => {
                const s = Reveal.getCurrentSlide();
                const f = [...s.querySelectorAll('.mv-frame')].find(e => e.getClientRects().length > 0);
                const b = f.querySelector('.mv-block'), id = f.querySelector('.mv-id');
                return {font: parseFloat(getComputedStyle(f).fontSize), block: b && b.getBoundingClientRect().width,
                        id: id && parseFloat(getComputedStyle(id).fontSize), scale: Reveal.getScale()};
            }""")
            assert size["font"] >= 20 and (size["block"] is None or size["block"] >= 40 * size["scale"] - 1), size
            assert size["id"] is None or size["id"] >= 22, size
            # the whole frame fits on the 800-pixel screen (the notebook's 12 requests and 40 blocks in 04)
            height = page.evaluate("""() => [...Reveal.getCurrentSlide().querySelectorAll('.mv-frame')]
                .find(e => e.getClientRects().length > 0).getBoundingClientRect().height""")
            assert height <= 800 - 60, height  # 60 px for the Play button and the slider above it
            page.screenshot(path=str(tmp_path / f"{stem}.png"))
            # the speaker view's notes for this slide come from the run sheet (or, for the title, its overview)
            assert "Segment" in page.evaluate("() => Reveal.getSlideNotes() || ''"), stem
            # Play (06 starts the animator one step before the first preemption)
            play = page.evaluate("() => { const b = Reveal.getCurrentSlide().querySelector('.widget-play button');"
                                 " b.click(); return true; }")
            assert play
            # playing: the step advances until a request moves between the queues (a finish, an admission, a
            # preemption), which every animated run in the course has within its first 20 steps
            page.wait_for_function(
                f"() => {{ const f = ({VISIBLE_FRAME})(); return f && f.step > {first['step']} && "
                f"JSON.stringify([f.waiting, f.running]) !== {json.dumps(json.dumps([first['waiting'], first['running']], separators=(',', ':')))}; }}",
                timeout=40_000)
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
