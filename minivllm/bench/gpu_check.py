"""The GPU check: correctness and speed of minivllm's CUDA path in one run, written to a JSON file.

``./course.sh gpu-check --out gpu_check.json`` (or ``python -m minivllm.bench.gpu_check``) on a CUDA machine;
``--dry-run`` runs every section on the CPU with tiny sizes (the Triton kernels under ``TRITON_INTERPRET=1``),
which is what the CPU test suite does to keep the script working. Sized for an H200 in under 6 minutes, with
Python 3.12, torch 2.11, triton 3.6, transformers 5.x, no ``gguf`` package and no network: the models are the
architectures with seeded random weights (``minivllm.bench.random_models``), identical in minivllm and in
transformers.

Sections (each one's result, or its error, goes to the JSON; the file is rewritten after every section, so a run
cut short still leaves what it finished). On a GPU each section runs in a child process of its own
(``--isolate``), so that a CUDA error in one cannot fail the others:

* ``env``: GPU, versions, date, the attention backends the engine offers and the one it picks by default.
* ``kernels``: the Triton kernels (``minivllm.attention.ops``) against ``reference_paged_attention`` on real
  sizes (SmolLM2-135M and 1B heads, decode batches, prefill chunks with context, long decodes split over the
  context), float32 / float16 / bfloat16, block sizes 16 and 32; the KV write against ``write_kv_cache``; one
  layer's decode attention (KV write + attention) of ``TRITON_ATTN`` against ``TORCH_SDPA``'s gather + ``bmm``.
* ``equality``: greedy tokens of the engine equal to transformers' ``generate`` in float32, for unchunked and
  chunked prefill, with preemption, with and without CUDA graphs, for every attention backend (``TRITON_ATTN``,
  ``TORCH_SDPA``, ``REFERENCE``).
* ``throughput``: the benchmark's 64-request workload (``minivllm.bench.workload.random_workload``) and a batch-1
  decode in bfloat16, ``TRITON_ATTN`` and ``TORCH_SDPA``, each eager and with CUDA graphs (the captured batch
  sizes and each capture's warm-up + capture seconds reported), against transformers' ``generate`` in the same
  process; ``gains`` gives the ratios: Triton over SDPA eager, CUDA graphs over eager, both over SDPA eager.
* ``bandwidth_1b``: batch-1 decode of a 1B-parameter Llama shape, where reading the weights dominates.
* ``limits``: the GPU's measured copy bandwidth and bfloat16 matmul rate next to the nominal H200 figures, and
  every batch-1 decode against its bandwidth floor.

Exit status 0 when every correctness check passed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from typing import Callable, Dict, List, Optional

H200_BANDWIDTH = 4.3e12  # bytes/s, HBM3e, as measured on such machines (the figure)
H200_BF16_FLOPS = 790e12  # FLOP/s, dense bf16 matmul, as measured on such machines

# The sizes of a real run and of the CPU dry run.
REAL = dict(
    model="SMOLLM2_135M", big_model="LLAMA_1B",
    eq_prompt_lens=[160, 37, 90, 250], eq_max_tokens=32, eq_chunk_budget=64, eq_preempt_blocks=24,
    wl_requests=64, wl_prompt_len=(100, 300), wl_output_len=(32, 128), hf_batch_sizes=[16, 64],
    lat_prompt_len=160, lat_output_len=128, repeats=2, perf_dtype="bfloat16",
)
DRY = dict(
    model="TINY", big_model="TINY",
    eq_prompt_lens=[30, 14, 20], eq_max_tokens=6, eq_chunk_budget=16, eq_preempt_blocks=5,
    wl_requests=4, wl_prompt_len=(10, 30), wl_output_len=(3, 6), hf_batch_sizes=[4],
    lat_prompt_len=20, lat_output_len=6, repeats=1,
    # The interpreted Triton kernels refuse bfloat16 (their tl.dot is wrong there): the dry run's speed sections
    # run in float32, so that they exercise TRITON_ATTN too.
    perf_dtype="float32",
)
# The engine's attention backends this script runs (CPU_ATTN runs on the CPU only: bfloat16, and float32 under
# MINIVLLM_CPU_KERNELS_FP32=1).
BACKEND_CANDIDATES = ("TRITON_ATTN", "TORCH_SDPA", "REFERENCE")
TOLERANCE = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}


class Context:
    """What the sections share: arguments, sizes, device, the deadline, the models built so far."""

    def __init__(self, args, sizes: Dict, device: str, deadline: float) -> None:
        self.args = args
        self.sizes = sizes
        self.device = device
        self.deadline = deadline
        self.tmp = tempfile.mkdtemp(prefix="minivllm-gpu-check-")
        self.hf_fp32 = None  # the float32 transformers model of ``equality``, reused (in bf16) by ``throughput``
        self.model_folder: Optional[str] = None  # its save_pretrained folder
        self.backends: List[str] = (args.backends.upper().split(",") if args.backends
                                    else available_backends(device, "float32"))

    def sync(self) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()


# ---- env ----------------------------------------------------------------------------------------------------
def available_backends(device: str, dtype: str, head_size: int = 64) -> List[str]:
    """The names among ``BACKEND_CANDIDATES`` that the engine's selector accepts for ``device`` and ``dtype``
    (``TRITON_ATTN`` on CUDA with compiled kernels, or on the CPU under ``TRITON_INTERPRET=1`` in float32)."""
    import torch

    from minivllm.attention.selector import get_attn_backend

    ok = []
    for name in BACKEND_CANDIDATES:
        try:
            get_attn_backend(torch.device(device), getattr(torch, dtype), name, head_size=head_size)
            ok.append(name)
        except ValueError:
            pass  # the selector refuses this backend for this device, dtype or head size: not a candidate here
    return ok


def section_env(ctx: Context) -> Dict:
    import torch
    import transformers

    out = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "device": ctx.device,
        "dry_run": ctx.args.dry_run,
        "sizes": ctx.sizes,
    }
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError as e:
        out["triton"] = f"not importable: {e}"
    if ctx.device == "cuda":
        p = torch.cuda.get_device_properties(0)
        out.update(gpu=torch.cuda.get_device_name(0), gpu_capability=f"{p.major}.{p.minor}",
                   gpu_memory_gib=round(p.total_memory / 2**30, 1), gpu_sms=p.multi_processor_count)
    from minivllm.attention.selector import get_attn_backend

    out["attention_backends"] = ctx.backends
    out["default_backend"] = {dt: get_attn_backend(torch.device(ctx.device), getattr(torch, dt), head_size=64).get_name()
                              for dt in ("float32", "bfloat16")}
    return out


# ---- kernels ------------------------------------------------------------------------------------------------
def paged_batch(ctxs, qlens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed=0):
    """Random queries and a paged cache with scattered blocks, and the step's ``CommonAttentionMetadata`` and
    reference ``AttentionMetadata``. Returns ``(query, kv_cache, cm, md)``."""
    import torch

    from minivllm.attention.backend import AttentionMetadata
    from minivllm.worker.block_table import create_common_attn_metadata

    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctxs, qlens)]
    nblk = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(nblk) + 8
    ids = torch.randperm(num_blocks, generator=g)[: sum(nblk)].tolist()
    tables, o = [], 0
    for n in nblk:
        tables.append(ids[o : o + n])
        o += n
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(device, dtype)
    query = torch.randn(sum(qlens), num_heads, head_dim, generator=g).to(device, dtype)
    cm = create_common_attn_metadata(tables, list(ctxs), list(qlens), block_size, device=device)
    return query, kv_cache, cm, AttentionMetadata(**AttentionMetadata.common_fields(cm, block_size))


def _kernel_cases(dry: bool):
    """``(name, ctxs, qlens, num_heads, num_kv_heads, head_dim, block_size)`` of the kernel checks."""
    import numpy as np

    if dry:
        return [("decode", [5, 40, 0], [1, 1, 1], 4, 2, 32, 16),
                ("mixed", [37, 0, 3], [9, 17, 1], 6, 2, 64, 32),
                ("split_decode", [700], [1], 2, 2, 32, 16)]
    rng = np.random.default_rng(0)
    ctx64 = rng.integers(100, 431, 64).tolist()
    return [
        ("smollm_decode_64", ctx64, [1] * 64, 9, 3, 64, 16),
        ("smollm_mixed", [0, 512, 130, 0] + ctx64[:32], [256, 256, 300, 77] + [1] * 32, 9, 3, 64, 32),
        ("smollm_long_decode_split", [8000, 6000, 3000, 100], [1, 1, 1, 1], 9, 3, 64, 16),
        ("llama1b_decode_16", ctx64[:16], [1] * 16, 32, 8, 64, 16),
        ("llama1b_prefill_chunk", [1024, 0], [512, 333], 32, 8, 64, 32),
        ("head_dim_128", [300, 0], [1, 200], 16, 4, 128, 16),
    ]


def section_kernels(ctx: Context) -> Dict:
    import torch

    from minivllm.attention.backends.reference import reference_paged_attention
    from minivllm.attention.ops import triton_reshape_and_cache_flash as rc
    from minivllm.attention.ops import triton_unified_attention as ua

    dev, dry = ctx.device, ctx.args.dry_run
    if dev == "cpu":
        from minivllm.attention.ops.triton_utils import interpreter_problem

        if interpreter_problem():
            return {"skipped": interpreter_problem(), "passed": True}
    dtypes = [torch.float32, torch.float16] + ([] if dry else [torch.bfloat16])
    out: Dict = {"interpreted": dev == "cpu", "attention": [], "kv_write": [], "timing": []}
    if dry:
        out["bfloat16"] = "not checked: the interpreter's tl.dot of bfloat16 is wrong (checked on the GPU)"
    passed = True
    for i, (name, ctxs, qlens, h, kvh, d, bs) in enumerate(_kernel_cases(dry)):
        # float16 on the first two cases only: each (dtype, shape) is one more Triton compile on the GPU.
        for dtype in [t for t in dtypes if t != torch.float16 or i < 2]:
            query, kv_cache, _, md = paged_batch(ctxs, qlens, h, kvh, d, bs, dtype, dev)
            ref = reference_paged_attention(query.float(), kv_cache.float(), md, d ** -0.5)
            res = torch.full_like(query, float("nan"))
            segments = ua.choose_num_segments(len(ctxs), kvh, max(qlens), max(md.seq_lens_cpu))
            ua.unified_attention(query, kv_cache[0], kv_cache[1], res, md.query_start_loc, max(qlens), md.seq_lens,
                                 max(md.seq_lens_cpu), d ** -0.5, md.block_table)
            err = (res.float() - ref).abs().max().item()
            dname = str(dtype).replace("torch.", "")
            ok = err < TOLERANCE[dname]
            passed &= ok
            out["attention"].append(dict(case=name, dtype=dname, num_seqs=len(ctxs), tokens=sum(qlens),
                                         heads=f"{h}/{kvh}", head_dim=d, block_size=bs, segments=segments,
                                         max_abs_err=err, tol=TOLERANCE[dname], passed=ok))
    for dtype in [torch.float32, torch.float16, torch.bfloat16]:
        for bs in (16, 32):
            g = torch.Generator().manual_seed(bs)
            n, kvh, d, nb = 37, 3, 64, 12
            key = torch.randn(n, kvh, d, generator=g).to(dev, dtype)
            value = torch.randn(n, kvh, d, generator=g).to(dev, dtype)
            slots = torch.randperm(nb * bs, generator=g)[:n].to(dev)
            slots[::5] = -1  # padding tokens: not written
            cache = torch.randn(2, nb, bs, kvh, d, generator=g).to(dev, dtype)
            expected = cache.clone()
            keep = slots >= 0
            from minivllm.attention.paged_attention import write_kv_cache

            write_kv_cache(key[keep], value[keep], expected, slots[keep])
            rc.triton_reshape_and_cache_flash(key, value, cache[0], cache[1], slots)
            ok = bool(torch.equal(cache, expected))
            passed &= ok
            out["kv_write"].append(dict(dtype=str(dtype).replace("torch.", ""), block_size=bs, equal=ok))
    if dev == "cuda":
        try:  # timing is information, not a check: its failure must not lose the results above
            out["timing"] = _time_decode_kernels(ctx)
        except Exception:
            out["timing_error"] = traceback.format_exc()[-3000:]
    out["passed"] = passed
    return out


def _graph_seconds(fn, reps: int) -> float:
    """Seconds per call of ``fn`` when ``reps`` calls are captured in one CUDA graph and replayed."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graphs recommends
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def _time_both(query, kv_cache, cm, reps: int = 20) -> Dict:
    """One layer's decode attention, KV write included, through ``TRITON_ATTN`` and ``TORCH_SDPA`` (their
    builders and implementations, as the engine calls them)."""
    import torch

    from minivllm.attention.backends.torch_sdpa import TorchSDPABackend
    from minivllm.attention.backends.triton_attn import TritonAttentionBackend

    t, h, d = query.shape
    kvh, bs = kv_cache.shape[3], kv_cache.shape[2]
    g = torch.Generator(device=query.device).manual_seed(0)
    key = torch.randn(t, kvh, d, generator=g, device=query.device).to(query.dtype)
    value = torch.randn(t, kvh, d, generator=g, device=query.device).to(query.dtype)
    calls = {}
    for label, backend in (("triton_attn", TritonAttentionBackend), ("torch_sdpa", TorchSDPABackend)):
        md = backend.get_builder_cls()(bs, h, kvh, d, query.dtype, query.device).build(cm)
        impl = backend.get_impl_cls()(h, d, d ** -0.5, kvh)
        calls[label] = (lambda impl=impl, md=md: impl.forward(query, key, value, kv_cache, md))
    row = {}
    for label, fn in calls.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        row[f"{label}_us"] = round((time.perf_counter() - start) / reps * 1e6, 1)
    row["speedup"] = round(row["torch_sdpa_us"] / row["triton_attn_us"], 2)
    # The same calls replayed from a CUDA graph: GPU time only, without Python's launch overhead.
    for label, fn in calls.items():
        try:
            row[f"{label}_graph_us"] = round(_graph_seconds(fn, reps) * 1e6, 1)
        except Exception as e:  # a path that cannot be captured is reported, not fatal
            row[f"{label}_graph_us"] = f"not capturable: {e!r}"[:300]
    a = calls["triton_attn"]().float()
    row["max_abs_diff"] = (a - calls["torch_sdpa"]().float()).abs().max().item()
    return row


def _time_decode_kernels(ctx: Context) -> List[Dict]:
    """Microseconds per layer call of a pure-decode batch: ``TRITON_ATTN`` (KV write + unified attention)
    against ``TORCH_SDPA`` (KV write, gather + two ``bmm``: ``torch_sdpa.paged_decode_attention``), bfloat16;
    called from Python (``*_us``, what an eager engine pays) and replayed from a CUDA graph (``*_graph_us``, GPU
    time)."""
    import numpy as np
    import torch

    rows = []
    rng = np.random.default_rng(1)
    cases = [("smollm_64_decodes", 64, 100, 430, 9, 3), ("smollm_1_decode_4k", 1, 4000, 4000, 9, 3),
             ("llama1b_64_decodes", 64, 100, 430, 32, 8)]
    for name, n, lo, hi, h, kvh in cases:
        ctxs = rng.integers(lo, hi + 1, n).tolist()
        query, kv_cache, cm, _ = paged_batch(ctxs, [1] * n, h, kvh, 64, 16, torch.bfloat16, "cuda")
        row = {"case": name, "num_seqs": n, "keys": sum(cm.seq_lens_cpu_upper_bound)}
        row.update(_time_both(query, kv_cache, cm))
        rows.append(row)
    return rows


# ---- equality -----------------------------------------------------------------------------------------------
def _prompts(lens: List[int], vocab: int, seed: int = 0) -> List[List[int]]:
    import numpy as np

    from minivllm.bench.workload import FIRST_TOKEN_ID

    rng = np.random.default_rng(seed)
    return [rng.integers(FIRST_TOKEN_ID, vocab, n).tolist() for n in lens]


def _hf_greedy(hf, prompts: List[List[int]], max_tokens: int, device: str):
    """Greedy tokens of ``hf.generate`` per prompt (batch 1, no padding) and the top-1 / top-2 logit gap of
    every step (to tell a real mismatch from a near tie)."""
    import torch

    tokens, gaps = [], []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            res = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                              min_new_tokens=max_tokens, do_sample=False, num_beams=1, pad_token_id=0,
                              eos_token_id=None, output_scores=True, return_dict_in_generate=True)
            tokens.append(res.sequences[0, len(p):].tolist())
            gaps.append([float(s[0].float().topk(2).values.diff().abs()) for s in res.scores])
    return tokens, gaps


def _engine_tokens(model, prompts, max_tokens, ctx: Context, backend: str, eager: bool, **engine_kw):
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.sampling_params import SamplingParams

    engine = LLMEngine(model, device=ctx.device, attention_backend=backend, enforce_eager=eager, **engine_kw)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(None, {"prompt_token_ids": p}, params) for p in prompts]
    got: Dict[str, List[int]] = {i: [] for i in ids}
    steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            got[o.request_id].extend(o.new_token_ids)
        steps += 1
    gr = engine.model_runner.graph_runner
    info = dict(steps=steps, num_preemptions=engine.num_preemptions,
                graph_replays=gr.num_replays if gr is not None else 0)
    return [got[i] for i in ids], info


def section_equality(ctx: Context) -> Dict:
    import torch

    from minivllm.bench import random_models

    s = ctx.sizes
    shape = getattr(random_models, s["model"])
    hf = random_models.build_hf_random_model(shape, seed=0, dtype=torch.float32, device=ctx.device)
    folder = os.path.join(ctx.tmp, "model")
    model = random_models.save_and_load(hf, folder, dtype=torch.float32, device=ctx.device)
    ctx.hf_fp32, ctx.model_folder = hf, folder
    prompts = _prompts(s["eq_prompt_lens"], shape["vocab_size"])
    n = s["eq_max_tokens"]
    ref, gaps = _hf_greedy(hf, prompts, n, ctx.device)
    flat = [t for r in ref for t in r]
    out: Dict = {
        "model": s["model"], "params": random_models.num_params(shape), "prompt_lens": s["eq_prompt_lens"],
        "max_tokens": n, "hf_attn_implementation": hf.config._attn_implementation,
        # A random model that only repeated its input would make equality trivial: how often it does.
        "hf_distinct_tokens": len(set(flat)),
        "hf_repeat_previous_fraction": round(
            sum(a == b for r in ref for a, b in zip(r, r[1:])) / max(1, len(flat) - len(ref)), 3),
        "hf_min_top2_gap": min(min(g) for g in gaps), "scenarios": [],
    }
    unchunked = dict(enable_chunked_prefill=False, max_num_batched_tokens=1024, max_model_len=1024)
    scenarios = [
        ("unchunked", False, unchunked),
        ("chunked", False, dict(enable_chunked_prefill=True, max_num_batched_tokens=s["eq_chunk_budget"])),
        ("preemption", False, dict(enable_chunked_prefill=True, max_num_batched_tokens=s["eq_chunk_budget"],
                                   num_gpu_blocks=s["eq_preempt_blocks"], enable_prefix_caching=False)),
        ("unchunked_eager", True, unchunked),
    ]
    passed = True
    for backend in ctx.backends:
        for name, eager, kw in scenarios:
            if eager and ctx.device != "cuda":
                continue  # no CUDA graphs on the CPU: the eager run is the other one
            got, info = _engine_tokens(model, prompts, n, ctx, backend, eager, **kw)
            mism = []
            for i, (a, b) in enumerate(zip(got, ref)):
                if a != b:
                    j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                    mism.append(dict(request=i, first_index=j, hf_top2_gap=gaps[i][j] if j < len(gaps[i]) else None))
            ok = not mism and (name != "preemption" or info["num_preemptions"] > 0)
            passed &= ok
            out["scenarios"].append(dict(backend=backend, scenario=name, cuda_graphs=ctx.device == "cuda" and not eager,
                                         engine_kwargs=kw, equal=not mism, mismatches=mism, passed=ok, **info))
    out["passed"] = passed
    return out


# ---- throughput ---------------------------------------------------------------------------------------------
def _perf_engine(model, ctx: Context, backend: str, eager: bool):
    from minivllm.engine.llm_engine import LLMEngine

    return LLMEngine(model, device=ctx.device, attention_backend=backend, enforce_eager=eager)


def _run_minivllm(model, ctx: Context, backend: str, eager: bool, workload) -> Dict:
    """Warm-up on the whole workload (it captures every CUDA graph the timed runs need), then timed runs."""
    from minivllm.bench.engine_run import run_engine

    engine = _perf_engine(model, ctx, backend, eager)
    t = time.perf_counter()
    run_engine(engine, workload, progress=False)
    warmup_s = time.perf_counter() - t
    runs = []
    for _ in range(ctx.sizes["repeats"]):
        engine.reset_prefix_cache()
        runs.append(run_engine(engine, workload, progress=False))
    best = sorted(runs, key=lambda r: r.elapsed_s)[len(runs) // 2]
    gr = engine.model_runner.graph_runner
    row = {k: v for k, v in best.to_json().items() if k not in ("token_ids",)}
    row.update(backend=backend, mode="eager" if eager else "cuda_graphs", warmup_s=round(warmup_s, 2),
               elapsed_runs_s=[round(r.elapsed_s, 3) for r in runs])
    if gr is not None:
        # The batch sizes a decode step is padded to, and what was captured: (padded batch B, padded block-table
        # width NB) with the seconds of its two warm-up forwards + capture (Triton compiles during the warm-up).
        row["capture_sizes"] = list(gr.sizes)
        row["graphs_captured"] = sorted([list(k) for k in gr.graphs])
        row["capture_seconds"] = {f"{b}x{nb}": round(t, 3) for (b, nb), t in sorted(gr.capture_seconds.items())}
        row["capture_seconds_total"] = round(sum(gr.capture_seconds.values()), 2)
        row["graph_replays"] = gr.num_replays
    row["_tokens"] = best.token_ids
    return row


def _run_hf(hf, ctx: Context, workload, batch_size: int) -> Dict:
    from minivllm.bench.hf_peer import run_hf_generate

    run_hf_generate(hf, workload.subset(min(2, workload.num_requests)), batch_size=batch_size, progress=False)
    runs = [run_hf_generate(hf, workload, batch_size=batch_size, progress=False) for _ in range(ctx.sizes["repeats"])]
    best = sorted(runs, key=lambda r: r.elapsed_s)[len(runs) // 2]
    row = {k: v for k, v in best.to_json().items() if k != "token_ids"}
    row["_tokens"] = best.token_ids
    return row


def _perf_backends(ctx: Context, dtype: str) -> List[str]:
    """The requested backends that run in ``dtype`` here, without the slow ``REFERENCE`` (unless it is all)."""
    ok = [b for b in ctx.backends if b in available_backends(ctx.device, dtype)]
    return [b for b in ok if b != "REFERENCE"] or ok[:1]


GAINS = (  # (label, (backend, mode) measured, (backend, mode) it is compared with)
    ("triton_over_sdpa_eager", ("TRITON_ATTN", "eager"), ("TORCH_SDPA", "eager")),
    ("triton_over_sdpa_cuda_graphs", ("TRITON_ATTN", "cuda_graphs"), ("TORCH_SDPA", "cuda_graphs")),
    ("cuda_graphs_over_eager_triton", ("TRITON_ATTN", "cuda_graphs"), ("TRITON_ATTN", "eager")),
    ("cuda_graphs_over_eager_sdpa", ("TORCH_SDPA", "cuda_graphs"), ("TORCH_SDPA", "eager")),
    ("triton_cuda_graphs_over_sdpa_eager", ("TRITON_ATTN", "cuda_graphs"), ("TORCH_SDPA", "eager")),
)


def _gains(rows: List[Dict], metric: str) -> Dict[str, Optional[float]]:
    """Ratios of ``metric`` (higher is better) between the runs named in ``GAINS``; ``None`` where a run is
    missing (no GPU: no CUDA graphs; a backend not run)."""
    by = {(r["backend"], r["mode"]): r.get(metric) for r in rows}
    out: Dict[str, Optional[float]] = {}
    for label, a, b in GAINS:
        out[label] = round(by[a] / by[b], 3) if by.get(a) and by.get(b) else None
    return out


def _decode_rows(model_rows: List[Dict], hf_rows: List[Dict], config, dtype) -> Dict:
    """Batch-1 decode against its floors: the bytes one step must read at the nominal bandwidth."""
    from minivllm.bench.roofline import step_cost

    wl_ctx = None
    out = {}
    for r in model_rows + hf_rows:
        label = r["system"] + ("" if r["system"] != "minivllm" else f"[{r['backend']},{r['mode']}]")
        wl_ctx = r["prompt_tokens"] + r["output_tokens"] // 2  # the average context of the decode steps
        cost = step_cost(config, dtype, [wl_ctx], [1])
        ms = 1e3 / r["decode_tok_s"] if r.get("decode_tok_s") else None
        out[label] = dict(decode_tok_s=r.get("decode_tok_s"), ms_per_token=ms,
                          bytes_per_step=cost.bytes, bandwidth_floor_ms=cost.bytes / H200_BANDWIDTH * 1e3,
                          compute_floor_ms=cost.flops / H200_BF16_FLOPS * 1e3,
                          fraction_of_bandwidth_bound=(cost.bytes / H200_BANDWIDTH * 1e3) / ms if ms else None)
    return out


def _ensure_model(ctx: Context) -> None:
    """The SmolLM2-shaped random model pair, when ``equality`` (which builds it) was not run."""
    from minivllm.bench import random_models

    if ctx.model_folder is None:
        shape = getattr(random_models, ctx.sizes["model"])
        ctx.hf_fp32 = random_models.build_hf_random_model(shape, seed=0, device=ctx.device)
        ctx.model_folder = os.path.join(ctx.tmp, "model")
        random_models.save_and_load(ctx.hf_fp32, ctx.model_folder, device=ctx.device)


def section_throughput(ctx: Context) -> Dict:
    import torch

    from minivllm.bench import random_models
    from minivllm.bench.workload import latency_workload, random_workload
    from minivllm.model.loader import load_model

    s = ctx.sizes
    dtype = getattr(torch, s["perf_dtype"])
    shape = getattr(random_models, s["model"])
    _ensure_model(ctx)
    model = load_model(ctx.model_folder, dtype=dtype, device=ctx.device)
    hf = ctx.hf_fp32.to(dtype)
    ctx.hf_fp32 = None
    wl = random_workload(s["wl_requests"], s["wl_prompt_len"], s["wl_output_len"], vocab_size=shape["vocab_size"])
    lat = latency_workload(s["lat_prompt_len"], s["lat_output_len"], vocab_size=shape["vocab_size"])
    modes = [True, False] if ctx.device == "cuda" else [True]
    out: Dict = {"dtype": s["perf_dtype"], "workload": wl.summary(), "latency_workload": lat.summary(), "runs": [],
                 "batch1": []}
    for backend in _perf_backends(ctx, s["perf_dtype"]):
        for eager in modes:
            out["runs"].append(_run_minivllm(model, ctx, backend, eager, wl))
            out["batch1"].append(_run_minivllm(model, ctx, backend, eager, lat))
    hf_runs = [_run_hf(hf, ctx, wl, bs) for bs in s["hf_batch_sizes"]]
    hf_lat = _run_hf(hf, ctx, lat, 1)
    out["transformers"] = hf_runs
    out["transformers_batch1"] = hf_lat
    best_hf = max(r["output_tok_s"] for r in hf_runs)
    best_ours = max(out["runs"], key=lambda r: r["output_tok_s"])
    out["speedup_vs_best_transformers"] = round(best_ours["output_tok_s"] / best_hf, 2)
    out["best_minivllm"] = f"{best_ours['backend']},{best_ours['mode']}"
    out["target_3x_met"] = out["speedup_vs_best_transformers"] >= 3.0
    # bf16 greedy tokens of minivllm and transformers on the workload: agreement is informative only (bf16
    # rounding differs between implementations and flips near ties), so it is recorded, not required.
    ref = hf_runs[0]["_tokens"]
    for r in out["runs"]:
        same = sum(a == b for a, b in zip(r["_tokens"], ref))
        r["requests_equal_to_transformers_bf16"] = f"{same}/{len(ref)}"
    out["gains"] = {"workload_output_tok_s": _gains(out["runs"], "output_tok_s"),
                    "batch1_decode_tok_s": _gains(out["batch1"], "decode_tok_s")}
    if ctx.device == "cpu":
        out["gains"]["note"] = "dry run: Triton kernels interpreted on the CPU, no CUDA graphs; not a speed measurement"
    out["batch1_vs_limits"] = _decode_rows(out["batch1"], [hf_lat], model.config, dtype)
    for r in out["runs"] + out["batch1"] + hf_runs + [hf_lat]:
        r.pop("_tokens", None)
    del model, hf
    if ctx.device == "cuda":
        torch.cuda.empty_cache()
    return out


def section_bandwidth_1b(ctx: Context) -> Dict:
    import torch

    from minivllm.bench import random_models
    from minivllm.bench.hf_peer import hf_model_from_minivllm
    from minivllm.bench.workload import latency_workload

    s = ctx.sizes
    shape = getattr(random_models, s["big_model"])
    dtype = getattr(torch, s["perf_dtype"])
    model = random_models.build_minivllm_random_model(shape, seed=1, dtype=dtype, device=ctx.device)
    lat = latency_workload(s["lat_prompt_len"], s["lat_output_len"], vocab_size=shape["vocab_size"])
    modes = [True, False] if ctx.device == "cuda" else [True]
    rows = [_run_minivllm(model, ctx, b, eager, lat) for b in _perf_backends(ctx, s["perf_dtype"]) for eager in modes]
    hf = hf_model_from_minivllm(model)
    hf_row = _run_hf(hf, ctx, lat, 1)
    for r in rows + [hf_row]:
        r.pop("_tokens", None)
    out = {"model": s["big_model"], "params": random_models.num_params(shape), "dtype": s["perf_dtype"],
           "latency_workload": lat.summary(), "batch1": rows, "transformers_batch1": hf_row,
           "gains": {"batch1_decode_tok_s": _gains(rows, "decode_tok_s")},
           "batch1_vs_limits": _decode_rows(rows, [hf_row], model.config, dtype)}
    del model, hf
    if ctx.device == "cuda":
        torch.cuda.empty_cache()
    return out


def section_limits(ctx: Context) -> Dict:
    """This GPU's copy bandwidth (read + write of a 2 GiB buffer) and bf16 matmul rate (8192^3), medians."""
    import torch

    mib, n = (2048, 8192) if ctx.device == "cuda" else (16, 256)
    src = torch.ones(mib * 2**20 // 2, dtype=torch.bfloat16, device=ctx.device)
    dst = torch.empty_like(src)
    a = torch.randn(n, n, dtype=torch.bfloat16, device=ctx.device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=ctx.device)

    def median(fn, reps=10):
        fn()
        ctx.sync()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            ctx.sync()
            ts.append(time.perf_counter() - t)
        return sorted(ts)[len(ts) // 2]

    bw = 2 * src.numel() * 2 / median(lambda: dst.copy_(src))
    flops = 2 * n**3 / median(lambda: a @ b)
    return {"copy_bandwidth_bytes_s": bw, "bf16_matmul_flops": flops,
            "nominal_h200_bandwidth_bytes_s": H200_BANDWIDTH, "nominal_h200_bf16_flops": H200_BF16_FLOPS,
            "bandwidth_fraction_of_nominal": bw / H200_BANDWIDTH, "flops_fraction_of_nominal": flops / H200_BF16_FLOPS}


SECTIONS: List[tuple] = [
    ("env", section_env),
    ("kernels", section_kernels),
    ("equality", section_equality),
    ("throughput", section_throughput),
    ("bandwidth_1b", section_bandwidth_1b),
    ("limits", section_limits),
]
CORRECTNESS = ("kernels", "equality")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minivllm.bench.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="gpu_check.json", help="results file (rewritten after every section)")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU (kernels under TRITON_INTERPRET=1)")
    p.add_argument("--sections", default=",".join(n for n, _ in SECTIONS), help="comma-separated subset")
    p.add_argument("--backends", default=None, help="attention backends to run (default: every one the engine has)")
    p.add_argument("--budget-s", type=float, default=330.0,
                   help="sections that would start after this many seconds are skipped")
    p.add_argument("--isolate", choices=["auto", "yes", "no"], default="auto",
                   help="one child process per section (auto: on a GPU), so that a crash or a CUDA error in one "
                        "section cannot take the others with it")
    return p


def run_isolated(args, names: List[str], results: Dict, write: Callable[[], None], start: float) -> None:
    """Run each section in a child process (this script with ``--isolate no --sections NAME``) and merge the
    results. A CUDA error (an illegal address in a kernel, say) leaves a process's CUDA context unusable, so in
    one process it would fail every later section too; a child that dies is recorded as that section's error."""
    import subprocess

    for name in [n for n, _ in SECTIONS if n in names]:
        left = args.budget_s - (time.monotonic() - start)
        if left <= 0:
            results["skipped"][name] = f"time budget of {args.budget_s} s spent"
            continue
        part = f"{args.out}.{name}.json"
        cmd = [sys.executable, "-m", "minivllm.bench.gpu_check", "--isolate", "no", "--sections", name,
               "--out", part, "--budget-s", str(left)]
        cmd += ["--dry-run"] if args.dry_run else []
        cmd += ["--backends", args.backends] if args.backends else []
        t = time.perf_counter()
        try:
            # A section that starts within the budget may end after it: a minute of grace before it is killed.
            rc = subprocess.run(cmd, timeout=left + 60).returncode
        except subprocess.TimeoutExpired:
            rc = "killed after the time budget"
        if os.path.exists(part):
            with open(part) as f:
                child = json.load(f)
            os.remove(part)
            if name in child:
                results[name] = child[name]
            results["errors"].update(child.get("errors", {}))
            results["skipped"].update(child.get("skipped", {}))
            results["gguf_imported"] = results.get("gguf_imported", False) or child.get("gguf_imported", False)
        else:
            results["errors"][name] = f"the section's process ended without results (exit status {rc})"
        results["section_seconds"][name] = round(time.perf_counter() - t, 1)  # process start-up included
        write()


def run_sections(ctx: Context, names: List[str], results: Dict, write: Callable[[], None]) -> None:
    for name, fn in SECTIONS:
        if name not in names:
            continue
        if time.monotonic() > ctx.deadline:
            results["skipped"][name] = f"time budget of {ctx.args.budget_s} s spent"
            continue
        t = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            results[name] = fn(ctx)
        except Exception:  # one failing section must not hide the others' results
            results["errors"][name] = traceback.format_exc()[-4000:]
            print(results["errors"][name], file=sys.stderr, flush=True)
        results["section_seconds"][name] = round(time.perf_counter() - t, 1)
        write()


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    names = args.sections.split(",")
    unknown = set(names) - {n for n, _ in SECTIONS}
    if unknown:
        raise SystemExit(f"--sections: unknown {sorted(unknown)}; known: {[n for n, _ in SECTIONS]}")
    isolate = args.isolate == "yes" or (args.isolate == "auto" and not args.dry_run and len(names) > 1)
    start = time.monotonic()
    results: Dict = {"skipped": {}, "errors": {}, "section_seconds": {}, "isolated": isolate}

    def write() -> None:
        results["total_seconds"] = round(time.monotonic() - start, 1)
        results["gguf_imported"] = results.get("gguf_imported", False) or "gguf" in sys.modules
        # Every requested correctness section ran and passed (a skipped one counts as not passed).
        checks = [(results.get(n) or {}).get("passed") is True for n in CORRECTNESS if n in names]
        results["correctness_passed"] = all(checks) and not results["errors"]
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(results, f, indent=1, default=str)
        os.replace(tmp, args.out)

    if not args.dry_run:
        import torch  # no CUDA context is created here: the children own the GPU

        if not torch.cuda.is_available():
            print("no CUDA device: run with --dry-run for the CPU version", file=sys.stderr)
            return 2
    if isolate:
        run_isolated(args, names, results, write, start)
        return _finish(args, results, write)
    if args.dry_run:
        # Must precede the first import of triton in this process (torch._dynamo imports it, so do transformers'
        # models): see minivllm/attention/ops/triton_utils.py.
        os.environ.setdefault("TRITON_INTERPRET", "1")
        # The CPU's C++ bfloat16 kernels are not what this script checks, and building them takes minutes.
        os.environ.setdefault("MINIVLLM_CPU_KERNELS", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch

    device = "cpu" if args.dry_run else "cuda"
    torch.manual_seed(0)
    ctx = Context(args, DRY if args.dry_run else REAL, device, start + args.budget_s)
    run_sections(ctx, names, results, write)
    return _finish(args, results, write)


def _finish(args, results: Dict, write: Callable[[], None]) -> int:
    write()
    print(json.dumps({k: results.get(k) for k in ("correctness_passed", "errors", "skipped", "section_seconds",
                                                  "total_seconds")}, indent=1, default=str)[:3000])
    print(f"results written to {args.out}")
    return 0 if results["correctness_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
