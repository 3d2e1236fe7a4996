"""``python -m minivllm.bench.vllm_check``: replay the scenarios on minivllm and compare with vLLM, step by step.

Without ``--vllm-python`` the vLLM side is read from the stored recordings (``vllm_recordings.json``; no vLLM
needed). With it (``./course.sh vllm-check`` passes ``.venv-vllm/bin/python``), vLLM is run first
(``vllm_recorder.py`` in that interpreter, as a subprocess) and its fresh recording is compared; ``--record``
also stores it as the new ``vllm_recordings.json``.

``--vllm033-python`` (``./course.sh vllm-check`` passes ``.venv-vllm033/bin/python``) also runs vLLM 0.33.0's own
``Scheduler`` and ``AsyncScheduler`` in the four scheduler-level modes and compares minivllm with them. Only the
scheduler: 0.33 is the GPU wheel, installed ``--no-deps`` beside the CPU torch with ``VLLM_TARGET_DEVICE=cpu``
(vLLM's CPU platform), and it has no CPU kernels, so its engine cannot run here. minivllm replays with its default
settings, which are vLLM 0.32's; on these scenarios (FCFS, no ``prefill_schedule_interval``) the two releases
decide alike, and the check shows it.

Exit status: 0 when every mode that ran agrees; 1 on any difference (the first differing step is printed side by
side); 1 also when a mode was skipped because minivllm cannot run it yet and ``--require-all-modes`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import List, Optional

from minivllm.bench.vllm_check import (
    MODES, RECORDINGS_PATH, SCENARIOS_PATH, load_recordings, load_scenarios, scenarios_sha256,
)


def record_with_vllm(vllm_python: str, out: str, modes: List[str], only: str = "",
                     extra_env: Optional[dict] = None) -> None:
    """Run ``vllm_recorder.py`` with the vLLM environment's Python (and ``extra_env``); it writes ``out``.

    Raises:
        RuntimeError: when the recorder fails (its output is printed as it runs).
    """
    from minivllm.bench.vllm_check.model_folder import ensure_model_folder

    cmd = [vllm_python, os.path.join(os.path.dirname(__file__), "vllm_recorder.py"), "--scenarios", SCENARIOS_PATH,
           "--out", out, "--modes", ",".join(modes)]
    if "v1-sync" in modes:
        cmd += ["--model", ensure_model_folder()]
    if only:
        cmd += ["--only", only]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **(extra_env or {}))
    r = subprocess.run(cmd, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"the vLLM recorder failed with exit status {r.returncode}: {' '.join(cmd)}")
    with open(out) as f:
        rec = json.load(f)
    rec["scenarios_sha256"] = scenarios_sha256()
    with open(out, "w") as f:
        json.dump(rec, f, indent=1)
        f.write("\n")


def check(recordings: dict, modes: List[str], only: Optional[List[str]] = None, verbose: bool = True,
          strict: bool = False):
    """Replay and compare. Returns ``(failures, skipped)``: lists of ``(mode, scenario, report)`` and
    ``(mode, reason)``."""
    from minivllm.bench.vllm_check import compare, minivllm_replay

    scenarios = {s["name"]: s for s in load_scenarios()["scenarios"]}
    failures, skipped = [], []
    for mode in modes:
        if mode not in recordings["modes"]:
            skipped.append((mode, "not in the vLLM recording"))
            continue
        why = minivllm_replay.unsupported_reason(mode)
        if why:
            skipped.append((mode, why))
            if verbose:
                print(f"SKIP {mode}: {why}", flush=True)
            continue
        rec = recordings["modes"][mode]
        for name, vrun in rec["scenarios"].items():
            if only and name not in only:
                continue
            t = time.time()
            mrun = minivllm_replay.replay(scenarios[name], mode)
            ok, report = compare.compare_run(vrun, mrun, rec["live"], strict=strict)
            if verbose:
                print(f"{'PASS' if ok else 'FAIL'} {mode:<17} {name:<34} {report.splitlines()[0]}  "
                      f"({time.time() - t:.1f} s)", flush=True)
                if not ok:
                    print(report, flush=True)
            if not ok:
                failures.append((mode, name, report))
    return failures, skipped


def check_vllm033(vllm_python: str, modes: List[str], only: str = "", strict: bool = False) -> list:
    """Record vLLM 0.33.0's scheduler in ``modes`` (scheduler-level only) and compare; returns the failures as
    ``check`` does, each mode named ``"<mode>@0.33"``."""
    t0 = time.time()
    scratch = tempfile.mkdtemp(prefix="vllm033_check_")
    path = os.path.join(scratch, "rec.json")
    print(f"==> recording vLLM 0.33 ({vllm_python}, scheduler only: the GPU wheel has no CPU kernels, so its "
          f"engine cannot run here) into {path}", flush=True)
    # VLLM_TARGET_DEVICE=cpu: vLLM's CPU platform (in the GPU wheel too); VLLM_CACHE_ROOT: not the home folder.
    record_with_vllm(vllm_python, path, modes, only,
                     {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CACHE_ROOT": os.path.join(scratch, "cache")})
    recordings = load_recordings(path)
    if not str(recordings.get("vllm_version", "")).startswith("0.33"):
        raise RuntimeError(f"{vllm_python} runs vLLM {recordings.get('vllm_version')}, not 0.33")
    print(f"==> vLLM {recordings['vllm_version']} recorded in {time.time() - t0:.0f} s", flush=True)
    failures, _ = check(recordings, modes, [s for s in only.split(",") if s] or None, strict=strict)
    return [(f"{m}@0.33", n, r) for m, n, r in failures]


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minivllm.bench.vllm_check", description=__doc__.split("\n")[0])
    p.add_argument("--vllm-python", help="the vLLM environment's python (run vLLM now instead of reading the "
                                         "stored recordings)")
    p.add_argument("--vllm033-python", help="a python with vLLM 0.33.0 installed --no-deps (scheduler only): also "
                                            "compare with 0.33's own scheduler in the scheduler-level modes")
    p.add_argument("--record", action="store_true", help=f"with --vllm-python: store the recording as {RECORDINGS_PATH}")
    p.add_argument("--recordings", default=RECORDINGS_PATH, help="recordings to compare with (default: stored)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--only", default="", help="comma-separated scenario names")
    p.add_argument("--strict", action="store_true", help="also fail on the known differences (compare.py)")
    p.add_argument("--require-all-modes", action="store_true",
                   help="fail when a mode is skipped because minivllm cannot run it yet")
    a = p.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        p.error(f"--modes: unknown {bad}; choose from {list(MODES)}")
    t0 = time.time()
    path = a.recordings
    if a.vllm_python:
        path = RECORDINGS_PATH if a.record else os.path.join(tempfile.mkdtemp(prefix="vllm_check_"), "rec.json")
        print(f"==> recording vLLM ({a.vllm_python}) into {path}", flush=True)
        record_with_vllm(a.vllm_python, path, modes, a.only)
        print(f"==> vLLM recorded in {time.time() - t0:.0f} s", flush=True)
    recordings = load_recordings(path)
    if recordings.get("scenarios_sha256") != scenarios_sha256():
        print(f"FAIL: {path} was recorded from other scenarios than {SCENARIOS_PATH}; re-record with "
              "./course.sh vllm-check --record", flush=True)
        return 1
    print(f"==> vLLM {recordings['vllm_version']} recorded {recordings['recorded_at']}", flush=True)
    for m in modes:
        if m in recordings["modes"]:
            print(f"    {m}: {recordings['modes'][m]['how']}", flush=True)
    if "v2_runner" in recordings.get("notes", {}):
        print(f"    note: {recordings['notes']['v2_runner']}", flush=True)
    t1 = time.time()
    failures, skipped = check(recordings, modes, [s for s in a.only.split(",") if s] or None, strict=a.strict)
    print(f"==> minivllm replay and comparison: {time.time() - t1:.0f} s; total {time.time() - t0:.0f} s")
    for mode, why in skipped:
        print(f"skipped {mode}: {why}")
    if not a.strict:
        from minivllm.bench.vllm_check.compare import KNOWN_DIFFERENCES

        for key, text in KNOWN_DIFFERENCES.items():
            print(f"known difference (excused; --strict fails on it) {key}: {text}")
    if a.vllm033_python:
        failures += check_vllm033(a.vllm033_python, [m for m in modes if m != "v1-sync"], a.only, a.strict)
    if failures:
        print(f"FAILED: {len(failures)} scenario run(s) differ from vLLM: "
              + ", ".join(f"{m}/{n}" for m, n, _ in failures))
        return 1
    if skipped and a.require_all_modes:
        print("FAILED: --require-all-modes and some modes were skipped")
        return 1
    print("OK: every compared mode agrees with vLLM step by step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
