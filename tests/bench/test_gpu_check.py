"""The prepared GPU check (``python -m minivllm.bench.gpu_check``) keeps working: its CPU dry run, tiny sizes.

It runs in a child process, as on the GPU machine: the dry run sets ``TRITON_INTERPRET=1`` before anything
imports triton, which must happen first in a process (``minivllm/attention/ops/triton_utils.py``).
"""

import json
import os
import subprocess
import sys

import pytest

from minivllm.bench import gpu_check
from minivllm.bench.random_models import SMOLLM2_135M, num_params


def test_dry_run_writes_passing_results(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "minivllm.bench.gpu_check", "--dry-run", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["errors"] == {} and r["skipped"] == {} and r["correctness_passed"] is True
    assert r["gguf_imported"] is False  # the GPU machine has no gguf package
    assert r["env"]["device"] == "cpu" and "TORCH_SDPA" in r["env"]["attention_backends"]
    assert r["env"]["default_backend"] == {"float32": "TORCH_SDPA", "bfloat16": "TORCH_SDPA"}  # CPU unchanged
    try:
        from minivllm.attention.ops.triton_utils import interpreter_problem
    except ImportError:
        triton_runs = False
    else:
        triton_runs = interpreter_problem() is None
    if triton_runs:
        assert r["kernels"]["interpreted"] and all(c["passed"] for c in r["kernels"]["attention"])
        assert {c["dtype"] for c in r["kernels"]["attention"]} == {"float32", "float16"}
        assert any(c["segments"] > 1 for c in r["kernels"]["attention"])  # the split-context path ran
    backends = ["TRITON_ATTN", "TORCH_SDPA", "REFERENCE"] if triton_runs else ["TORCH_SDPA", "REFERENCE"]
    assert r["env"]["attention_backends"] == backends
    scen = {(s["backend"], s["scenario"]): s for s in r["equality"]["scenarios"]}
    assert set(scen) == {(b, n) for b in backends for n in ("unchunked", "chunked", "preemption")}
    assert all(scen[(b, "preemption")]["num_preemptions"] > 0 for b in backends)
    assert all(s["equal"] for s in scen.values())
    tp = r["throughput"]
    assert tp["dtype"] == "float32"  # the interpreter refuses bfloat16
    assert [(x["backend"], x["mode"]) for x in tp["runs"]] == [(b, "eager") for b in backends if b != "REFERENCE"]
    assert all(x["output_tokens"] == tp["workload"]["output_tokens"] for x in tp["runs"])
    assert tp["transformers"][0]["output_tokens"] == tp["workload"]["output_tokens"]
    gains = tp["gains"]["workload_output_tok_s"]
    assert (gains["triton_over_sdpa_eager"] is not None) == triton_runs
    assert gains["cuda_graphs_over_eager_sdpa"] is None  # no CUDA graphs on the CPU
    assert set(r["section_seconds"]) == {name for name, _ in gpu_check.SECTIONS}


def test_sections_in_child_processes_are_merged(tmp_path):
    # What a GPU run does by default: one process per section, results merged into one file.
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    proc = subprocess.run([sys.executable, "-m", "minivllm.bench.gpu_check", "--dry-run", "--isolate", "yes",
                           "--sections", "env,limits", "--out", str(out)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["isolated"] is True and r["errors"] == {} and set(r["section_seconds"]) == {"env", "limits"}
    assert r["env"]["device"] == "cpu" and r["limits"]["copy_bandwidth_bytes_s"] > 0
    assert not list(tmp_path.glob("gpu_check.json.*"))  # the children's files are merged and removed


def test_smollm2_shape_has_135m_parameters():
    assert num_params(SMOLLM2_135M) == pytest.approx(134.5e6, rel=0.01)


def test_unknown_section_is_refused():
    with pytest.raises(SystemExit, match="unknown"):
        gpu_check.main(["--dry-run", "--sections", "env,nope", "--out", os.devnull])
