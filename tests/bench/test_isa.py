"""bench --isa: the caps that make an AVX-512 machine run the AVX2 class's code (minivllm/bench/isa.py)."""

import json
import os
import subprocess
import sys

import pytest

from minivllm import custom_ops, envs
from minivllm.bench import isa
from minivllm.bench.report import environment_line

CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "MINIVLLM_CPU_ISA": "avx2"}


def test_capped_env_sets_every_librarys_cap_and_leaves_the_base_alone():
    base = {"PATH": "/bin", "ATEN_CPU_CAPABILITY": "avx512"}
    env = isa.capped_env("avx2", base)
    assert env == dict(CAPS, PATH="/bin")
    assert base == {"PATH": "/bin", "ATEN_CPU_CAPABILITY": "avx512"}
    assert isa.capped_env("native", base) == base and isa.capped_env("native", base) is not base


def test_unknown_classes_are_refused_with_the_option_named():
    with pytest.raises(ValueError, match="--isa must be native or one of avx2, got 'avx512'"):
        isa.capped_env("avx512", {})


def test_active_cap_needs_every_variable():
    assert isa.active_cap(CAPS) == "avx2"
    assert isa.active_cap(dict(CAPS, ONEDNN_MAX_CPU_ISA="AVX512_CORE")) is None
    partial = dict(CAPS)
    del partial["MKL_ENABLE_INSTRUCTIONS"]
    assert isa.active_cap(partial) is None


def test_minivllm_cpu_isa_chooses_the_march_and_rejects_other_values(monkeypatch):
    monkeypatch.delenv("MINIVLLM_CPU_ISA", raising=False)
    assert "-march=native" in custom_ops.cflags()
    monkeypatch.setenv("MINIVLLM_CPU_ISA", "avx2")
    flags = custom_ops.cflags()
    assert "-march=x86-64-v3" in flags and "-march=native" not in flags and "-O3" in flags
    monkeypatch.setenv("MINIVLLM_CPU_ISA", "sse2")
    with pytest.raises(ValueError, match="MINIVLLM_CPU_ISA must be unset or one of avx2, got 'sse2'"):
        envs.MINIVLLM_CPU_ISA


def test_environment_line_says_a_capped_run_is_not_that_class():
    env = {"cpu": "AMD EPYC", "cpu_flags": ["avx2", "avx512f"], "cpu_count": 2, "torch_threads": 2,
           "loadavg": [0.1, 0.1, 0.1]}
    assert "capped" not in environment_line(env)
    line = environment_line(dict(env, isa_cap="avx2"))
    assert "AVX2 class" in line and "capped" in line and "not that class's figures" in line


def test_the_vllm_childs_sitecustomize_turns_torchs_avx512_queries_off(tmp_path):
    env = isa.write_vllm_child_sitecustomize("avx2", str(tmp_path), {"PATH": os.environ.get("PATH", "")})
    assert env["PYTHONPATH"] == str(tmp_path)
    code = ("import torch.cpu as c; print([c._is_avx512_supported(), c._is_avx512_bf16_supported(), "
            "c._is_amx_tile_supported()])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[False, False, False]"
    assert isa.write_vllm_child_sitecustomize("native", str(tmp_path / "x"), {"A": "1"}) == {"A": "1"}


def test_bench_isa_reruns_itself_capped_and_records_it(tmp_path):
    # The PyTorch operators (no C++ kernels to build): what is checked is the re-run under the caps and the record.
    env = {k: v for k, v in os.environ.items() if k not in CAPS}
    env.update(MINIVLLM_CPU_KERNELS="0", MINIVLLM_CPU_KERNELS_FP32="0")
    out_json = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "minivllm", "bench", "--model", "tiny", "--isa", "avx2", "--peers",
                        "none", "--cases", "latency", "--latency-prompt-len", "8", "--latency-output-len", "4",
                        "--repeats", "1", "--threads", "1", "--no-progress", "--json", str(out_json)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "run as the AVX2 class runs" in r.stdout
    data = json.loads(out_json.read_text())
    assert data["environment"]["isa_cap"] == "avx2"
    assert data["args"]["isa"] == "avx2"


def test_minivllm_cpu_isa_avx2_is_refused_on_a_cpu_without_avx2(monkeypatch):
    monkeypatch.setenv("MINIVLLM_CPU_ISA", "avx2")
    monkeypatch.setattr(custom_ops, "_cpu_id", lambda: "flags\t\t: fpu sse sse2 avx")
    with pytest.raises(ValueError, match="MINIVLLM_CPU_ISA=avx2 needs a CPU with AVX2 and FMA"):
        custom_ops.cflags()
