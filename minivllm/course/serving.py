"""Notebook 11's tools: minivllm's OpenAI-compatible server in a background thread of the notebook's kernel, and a
live view of its queues read from ``/metrics`` while a load runs.

``ServerThread`` runs uvicorn on an app from ``build_app`` in a daemon thread, so the notebook keeps the engine
object (a ``SchedulerTrace`` can watch its steps) and the server stops with ``stop()``; ``python -m minivllm
serve`` runs the same app in the foreground. ``QueueWatch`` polls ``/metrics`` (the gauges and counter of
``minivllm.entrypoints.openai.metrics``, vLLM's names) every ``interval_s`` and redraws one HTML strip: waiting and
running requests as squares, KV cache use as a bar, preemptions so far. It is what a Prometheus/Grafana board
would show of a ``vllm serve``, drawn in the notebook.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import httpx

from minivllm.i18n import _

_GAUGES = {"vllm:num_requests_waiting": "waiting", "vllm:num_requests_running": "running",
           "vllm:kv_cache_usage_perc": "kv_cache_usage", "vllm:num_preemptions_total": "preemptions"}


class ServerThread:
    """uvicorn serving ``app`` in a daemon thread.

    Args:
        app: an ASGI app (``minivllm.entrypoints.openai.api_server.build_app(...)``).
        host: bind address (``"127.0.0.1"``: this machine only; ``"0.0.0.0"``: every interface, for a classroom).
        port: TCP port; 0 lets the OS choose a free one.
        timeout_s: how long ``start`` waits for uvicorn to listen.

    Raises:
        RuntimeError: if uvicorn is not listening within ``timeout_s``.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0) -> None:
        import uvicorn

        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        self.port = sock.getsockname()[1]
        self.base_url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=3))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the server did not start within {timeout_s} s")
            time.sleep(0.02)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask uvicorn to exit and wait for its thread. Raises ``RuntimeError`` if it is still alive after ``timeout_s``."""
        self.server.should_exit = True
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise RuntimeError(f"the server thread did not stop within {timeout_s} s")


def parse_metrics(text: str) -> Dict[str, float]:
    """``{"waiting", "running", "kv_cache_usage", "preemptions"}`` from a Prometheus text page (vLLM's or
    minivllm's; values of all label sets summed). Absent metrics are left out."""
    out: Dict[str, float] = {}
    for name, key in _GAUGES.items():
        for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M):
            out[key] = out.get(key, 0.0) + float(m.group(1))
    return out


@dataclass
class Frame:
    """One poll of ``/metrics``: seconds since the watch started, and the four values."""

    t: float
    waiting: int
    running: int
    kv_cache_usage: float
    preemptions: int


def frame_html(f: Frame, max_squares: int = 40) -> str:
    """The strip of one frame: waiting and running requests as squares, the KV cache use as a bar."""
    def squares(n: int, color: str) -> str:
        shown = min(n, max_squares)
        more = f" +{n - shown}" if n > shown else ""
        return "".join(f'<span style="display:inline-block;width:11px;height:11px;margin:1px;background:{color}">'
                       "</span>" for _ in range(shown)) + more

    pct = max(0.0, min(1.0, f.kv_cache_usage)) * 100
    return (
        '<div style="font-family:monospace;line-height:1.7">'
        f"t = {f.t:5.2f} s<br>"
        + _("waiting {n:3d}").format(n=f.waiting) + f' {squares(f.waiting, "#f0a830")}<br>'
        + _("running {n:3d}").format(n=f.running) + f' {squares(f.running, "#3b7dd8")}<br>'
        + _("KV use {percent:5.1f} %").format(percent=pct)
        + ' <span style="display:inline-block;width:240px;height:11px;background:#ddd">'
        f'<span style="display:inline-block;width:{2.4 * pct:.0f}px;height:11px;background:#c0392b"></span></span><br>'
        + _("preemptions so far {n}").format(n=f.preemptions) + "</div>"
    )


class QueueWatch:
    """Poll ``base_url/metrics`` and redraw a live strip until ``stop()``; every poll is kept in ``frames``.

    Args:
        base_url: the server, e.g. ``http://127.0.0.1:8000``.
        interval_s: seconds between polls (> 0).
        display: redraw in the notebook (``IPython.display`` handle); ``False``: record only.
    """

    def __init__(self, base_url: str, interval_s: float = 0.1, display: bool = True) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.base_url, self.interval_s, self.display = base_url.rstrip("/"), interval_s, display
        self.frames: List[Frame] = []
        self._task: Optional[asyncio.Task] = None
        self._handle = None

    async def _run(self) -> None:
        t0 = time.perf_counter()
        async with httpx.AsyncClient(timeout=10) as client:
            while True:
                m = parse_metrics((await client.get(self.base_url + "/metrics")).text)
                f = Frame(time.perf_counter() - t0, int(m.get("waiting", 0)), int(m.get("running", 0)),
                          m.get("kv_cache_usage", 0.0), int(m.get("preemptions", 0)))
                self.frames.append(f)
                if self._handle is not None:
                    from IPython.display import HTML

                    self._handle.update(HTML(frame_html(f)))
                await asyncio.sleep(self.interval_s)

    def start(self) -> "QueueWatch":
        """Start polling in the running event loop (a notebook cell's ``await`` context)."""
        if self.display:
            from IPython.display import HTML, display

            self._handle = display(HTML("<i>" + _("waiting for the first poll") + "</i>"), display_id=True)
        self._task = asyncio.ensure_future(self._run())
        return self

    async def stop(self) -> List[Frame]:
        """Take one last poll, stop, and return the frames."""
        if self._task is not None:
            await asyncio.sleep(self.interval_s)
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        return self.frames
