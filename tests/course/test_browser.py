"""The queue animator in a real JupyterLab, in headless Chromium: run a notebook, press Play, watch it move.

Needs Debian's Chromium (``apt-get install chromium``; ``./course.sh test`` installs it when run as root) and
pip's ``playwright`` (driving that Chromium through ``executable_path``; ``playwright install`` is never needed).
Without Chromium the test is skipped. Everything Lab writes (settings, workspaces, checkpoints, the notebook)
goes to a temporary folder. Screenshots go there too, or to ``$MINIVLLM_SCREENSHOT_DIR`` when set.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
]

pytestmark = [
    pytest.mark.skipif(
        not os.path.exists(CHROMIUM),
        reason=f"{CHROMIUM} not found: install Debian's Chromium with `sudo apt-get install chromium` "
        "(./course.sh test does this when run as root) to run the browser test of the widgets",
    ),
    pytest.mark.timeout(170),
]

NOTEBOOK_CELLS = [
    "import os\nos.environ.setdefault('HF_HUB_OFFLINE', '1')\n"
    "from minivllm.course.figures import preemption_run\nfrom minivllm.course.viz import QueueAnimator\n"
    "trace = preemption_run().trace",
    "animator = QueueAnimator(trace, interval_ms=150)\nanimator",
]

SETTINGS = {  # plugin id -> settings that keep Lab quiet and out of the course folder
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_notebook(path: Path) -> None:
    nb = {
        "cells": [
            {"cell_type": "code", "execution_count": None, "id": f"c{i}", "metadata": {}, "outputs": [],
             "source": src}
            for i, src in enumerate(NOTEBOOK_CELLS)
        ],
        "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path.write_text(json.dumps(nb))


def _write_settings(settings_dir: Path) -> None:
    for plugin, values in SETTINGS.items():
        pkg, name = plugin.rsplit("/", 1)
        f = settings_dir / pkg / f"{name}.jupyterlab-settings"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(values))


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server on a free localhost port, rooted in ``tmp_path``; yields its base URL."""
    root = tmp_path / "root"
    root.mkdir()
    _write_notebook(root / "animator.ipynb")
    _write_settings(tmp_path / "settings")
    port = _free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JUPYTER_CONFIG_DIR=str(tmp_path / "config"), JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "ws"))
    cmd = [
        sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root", f"--port={port}",
        "--ServerApp.ip=127.0.0.1", "--ServerApp.port_retries=0", "--IdentityProvider.token=",
        "--ServerApp.password=", "--ServerApp.disable_check_xsrf=True", f"--ServerApp.root_dir={root}",
        "--LabApp.expose_app_in_browser=True", f"--LabApp.user_settings_dir={tmp_path / 'settings'}",
        f"--LabApp.workspaces_dir={tmp_path / 'ws'}",
        f"--FileCheckpoints.checkpoint_dir={tmp_path / 'checkpoints'}",
        "--LabApp.news_url=", "--LabServerApp.open_browser=False",
    ]
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"jupyter lab did not start:\n{(tmp_path / 'lab.log').read_text()[-3000:]}")
                time.sleep(0.3)
        yield url
    finally:
        try:  # stops the kernels and the server
            urllib.request.urlopen(urllib.request.Request(f"{url}/api/shutdown", method="POST"), timeout=5)
        except OSError:
            pass
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(timeout=5)
        log.close()


def _visible_frame(page) -> dict:
    """The step and queues of the frame the Stack shows now (hidden frames have no layout box)."""
    return page.evaluate(
        """() => {
            const f = [...document.querySelectorAll('.mv-frame')].find(e => e.getClientRects().length > 0);
            if (!f) return null;
            const q = name => [...f.querySelectorAll(`.mv-req[data-queue="${name}"]`)]
                .map(e => e.dataset.requestId);
            const table = f.querySelector('.mv-table');
            return {step: Number(f.dataset.step), waiting: q('waiting'), running: q('running'),
                    frames: document.querySelectorAll('.mv-frame').length,
                    reasons: [...f.querySelectorAll('.mv-why li:not([data-reason="none"])')].map(e => [e.dataset.reason, e.dataset.cause,
                                                                             e.dataset.requestId]),
                    table: table ? [table.dataset.requestId,
                                    [...table.querySelectorAll('td[data-block]')].map(e => Number(e.dataset.block))]
                                 : null};
        }"""
    )


def _eval(page, js: str, timeout_s: float):
    """``page.evaluate`` has no timeout of its own: race the script against one."""
    return page.evaluate(
        f"""() => Promise.race([
            (async () => {{ {js} }})(),
            new Promise((_, reject) => setTimeout(() => reject(new Error('timed out')), {int(timeout_s * 1000)}))
        ])"""
    )


def test_animator_plays_in_jupyterlab(lab, tmp_path):
    playwright = pytest.importorskip("playwright.sync_api", reason="pip install playwright (no browser download)")
    from minivllm.course.figures import preemption_run
    from minivllm.course.viz.explain import explain_step, next_event

    trace = preemption_run().trace
    shots = Path(os.environ.get("MINIVLLM_SCREENSHOT_DIR") or tmp_path / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.set_default_timeout(60_000)
            page.goto(f"{lab}/lab/tree/animator.ipynb")
            page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget "
                                   "&& window.jupyterapp.shell.currentWidget.sessionContext")
            _eval(page, "await window.jupyterapp.shell.currentWidget.sessionContext.ready; return true;", 60)
            _eval(page, "await window.jupyterapp.commands.execute('notebook:run-all-cells'); return true;", 60)
            # the widget manager rendered real widgets, not the plain-text repr or a JavaScript error
            page.wait_for_selector(".widget-play", timeout=60_000)
            page.wait_for_selector(".mv-frame", state="visible")
            assert page.locator(".jupyter-widgets").count() > 0
            assert "Click to show javascript error" not in page.content()
            first = _visible_frame(page)
            assert first["frames"] >= 1  # the Stack puts only frames shown so far into the page
            assert first["step"] == 0
            assert first["waiting"] == trace[0].waiting and first["running"] == trace[0].running
            page.screenshot(path=str(shots / "animator_step0.png"))

            # Play must get past the preemption (step 4) to a step whose queues differ from step 0's (step 8)
            pre, pre_id = trace.preemptions()[0]
            k_change = next(s.step for s in trace
                            if s.step > pre and (s.waiting, s.running) != (trace[0].waiting, trace[0].running))
            page.locator(".widget-play button").first.click()  # Play
            page.wait_for_function(
                f"""() => {{ const f = [...document.querySelectorAll('.mv-frame')]
                                .find(e => e.getClientRects().length > 0);
                            return f && Number(f.dataset.step) >= {k_change}; }}""",
                timeout=30_000,
            )
            page.locator(".widget-play button").first.click()  # the Play button toggles to Pause while playing
            later = _visible_frame(page)
            page.screenshot(path=str(shots / "animator_playing.png"))
            k = later["step"]
            assert k >= k_change
            # the queues shown are those of the step shown, and they differ from step 0's
            assert later["waiting"] == trace[k].waiting and later["running"] == trace[k].running
            assert (later["waiting"], later["running"]) != (first["waiting"], first["running"])
            readout = page.locator(".widget-readout").first.inner_text()
            assert int(readout) == k

            # step backwards with the keyboard on the slider handle: the frame follows
            page.locator(".widget-slider .noUi-handle").first.focus()
            page.keyboard.press("ArrowLeft")
            page.wait_for_function(
                f"""() => {{ const f = [...document.querySelectorAll('.mv-frame')]
                                .find(e => e.getClientRects().length > 0);
                            return f && Number(f.dataset.step) === {k - 1}; }}""",
                timeout=10_000,
            )
            back = _visible_frame(page)
            assert back["waiting"] == trace[k - 1].waiting and back["running"] == trace[k - 1].running
            page.screenshot(path=str(shots / "animator_back.png"))
            # every frame says why, as the explanation of its step does
            assert back["reasons"] == [[r.kind, r.cause, r.request_id or ""] for r in explain_step(trace, k - 1)]

            # the jump buttons (they run in the kernel): no preemption follows this step, a finish and an
            # admission do
            assert page.get_by_role("button", name="next preemption").is_disabled()
            for kind in ("finish", "admission"):
                here = _visible_frame(page)["step"]
                target = next_event(trace, here, kind)
                assert target is not None
                page.get_by_role("button", name=f"next {kind}").click()
                page.wait_for_function(
                    f"""() => {{ const f = [...document.querySelectorAll('.mv-frame')]
                                    .find(e => e.getClientRects().length > 0);
                                return f && Number(f.dataset.step) === {target}; }}""",
                    timeout=20_000,
                )
                jumped = _visible_frame(page)
                assert jumped["running"] == trace[target].running
                reason = {"finish": "finished", "admission": "admitted"}[kind]
                assert any(r[0] in (reason, "resumed") for r in jumped["reasons"]), jumped["reasons"]
                assert int(page.locator(".widget-readout").first.inner_text()) == target
            # the block table follows the request picked in the menu (the first preempted one until then)
            step = _visible_frame(page)["step"]
            assert _visible_frame(page)["table"][0] == pre_id
            rid = next(r for r in trace[step].running if r != pre_id)
            page.locator(".widget-dropdown select").first.select_option(label=rid)
            page.wait_for_function(
                f"""() => {{ const f = [...document.querySelectorAll('.mv-frame')]
                                .find(e => e.getClientRects().length > 0);
                            const t = f && f.querySelector('.mv-table');
                            return t && t.dataset.requestId === {json.dumps(rid)}; }}""",
                timeout=20_000,
            )
            assert _visible_frame(page)["table"] == [rid, trace[step].requests[rid].block_ids]
            page.screenshot(path=str(shots / "animator_buttons.png"))
        finally:
            browser.close()
    assert (shots / "animator_playing.png").stat().st_size > 10_000


def _npm_pack(dest: Path) -> dict:
    """Fetch the widget renderer and RequireJS from the npm registry (``npm pack``, no install); skip if that fails.

    Returns ``{"embed": path to embed-amd.js, "require": path to require.js}``.
    """
    import tarfile

    if shutil.which("npm") is None:
        pytest.skip("npm not found: the exported-HTML check needs `npm pack @jupyter-widgets/html-manager@1`")
    dest.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["npm", "pack", "@jupyter-widgets/html-manager@1", "requirejs@2", "--pack-destination",
                        str(dest)], capture_output=True, text=True, timeout=90)
    tgz = sorted(dest.glob("*.tgz"))
    if r.returncode != 0 or len(tgz) != 2:
        pytest.skip(f"npm pack failed (no access to the npm registry?): {r.stderr.strip()[-300:]}")
    for t in tgz:
        with tarfile.open(t) as tf:
            tf.extractall(dest / t.stem, filter="data")
    embed = next(dest.glob("jupyter-widgets-html-manager-*/package/dist/embed-amd.js"))
    require = next(dest.glob("requirejs-*/package/require.js"))
    return {"embed": embed, "require": require}


def test_exported_html_animates_without_a_kernel(tmp_path):
    """nbconvert's HTML of an executed notebook stores the widget state; with the widget renderer loaded from
    local files and every network request refused, Play still steps through the pre-rendered frames."""
    playwright = pytest.importorskip("playwright.sync_api", reason="pip install playwright (no browser download)")
    import nbformat
    from nbconvert import HTMLExporter
    from nbconvert.preprocessors import ExecutePreprocessor

    from minivllm.course.figures import preemption_run
    from minivllm.course.viz.explain import explain_step

    js = _npm_pack(tmp_path / "npm")
    _write_notebook(tmp_path / "animator.ipynb")
    nb = nbformat.read(tmp_path / "animator.ipynb", as_version=4)
    ExecutePreprocessor(timeout=120, kernel_name="python3", store_widget_state=True).preprocess(
        nb, {"metadata": {"path": str(tmp_path)}})
    html, _ = HTMLExporter(widget_renderer_url=js["embed"].as_uri(), require_js_url=js["require"].as_uri()
                           ).from_notebook_node(nb)
    page_file = tmp_path / "animator.html"
    page_file.write_text(html)

    trace = preemption_run().trace
    k_change = next(s.step for s in trace if s.step > 4 and (s.waiting, s.running) != (trace[0].waiting,
                                                                                          trace[0].running))
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS + ["--allow-file-access-from-files"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.route("http*://**", lambda route: route.abort())  # no kernel, no CDN: only the file itself
            page.goto(page_file.as_uri())
            page.wait_for_selector(".widget-play", timeout=30_000)
            first = _visible_frame(page)
            assert first["step"] == 0 and first["running"] == trace[0].running
            page.locator(".widget-play button").first.click()
            page.wait_for_function(
                f"""() => {{ const f = [...document.querySelectorAll('.mv-frame')]
                                .find(e => e.getClientRects().length > 0);
                            return f && Number(f.dataset.step) >= {k_change}; }}""",
                timeout=30_000,
            )
            page.locator(".widget-play button").first.click()
            later = _visible_frame(page)
            assert later["waiting"] == trace[later["step"]].waiting
            assert later["running"] == trace[later["step"]].running
            # the why box is part of the saved frames: it explains without a kernel
            assert later["reasons"] == [[r.kind, r.cause, r.request_id or ""]
                                        for r in explain_step(trace, later["step"])]
        finally:
            browser.close()
