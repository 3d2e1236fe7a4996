"""Command line: ``python -m minivllm generate|chat|serve|bench|figures``.

* ``generate "prompt" ...``: greedy (or sampled) completion of raw prompts, then a one-line summary of steps,
  tokens, tokens/s and preemptions.
* ``chat``: an interactive chat with the chat template (``--message`` for a single turn without a terminal).
* ``serve [model]``: the OpenAI-compatible server (``minivllm.entrypoints.openai.api_server``), as ``vllm serve``.
* ``bench``: the benchmark (``minivllm.bench``).
* ``figures``: regenerate the course figures in ``images/`` from real engine runs (``minivllm.course.figures``).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import List, Optional


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a .gguf file or Hugging Face folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None, help="cpu (default) or cuda")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")


def _make_llm(a):
    from minivllm import LLM

    return LLM(
        a.model, dtype=a.dtype, device=a.device, block_size=a.block_size, num_gpu_blocks=a.num_gpu_blocks,
        max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=a.max_num_seqs,
        enable_prefix_caching=not a.no_prefix_caching,
    )


def _params(a):
    from minivllm import SamplingParams

    return SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed, max_tokens=a.max_tokens)


def _summary(llm, outputs, seconds: float) -> str:
    eng = llm.llm_engine
    n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    n_in = sum(len(o.prompt_token_ids) for o in outputs)
    return (
        f"[minivllm] {len(outputs)} request(s), {eng.scheduler.stats.num_steps} steps, {n_in} prompt + {n_out} output "
        f"tokens in {seconds:.2f} s ({n_out / max(seconds, 1e-9):.1f} output tok/s), "
        f"{eng.num_preemptions} preemption(s), dtype {str(eng.dtype).replace('torch.', '')}, device {eng.device}"
    )


def cmd_generate(a) -> int:
    llm = _make_llm(a)
    t = time.perf_counter()
    outs = llm.generate(a.prompts, _params(a), use_tqdm=False)
    dt = time.perf_counter() - t
    for o in outs:
        print(f"--- {o.prompt!r}\n{o.outputs[0].text}\n(finish_reason={o.outputs[0].finish_reason})")
    print(_summary(llm, outs, dt))
    return 0


def cmd_chat(a) -> int:
    llm = _make_llm(a)
    history: List[dict] = []
    if a.system:
        history.append({"role": "system", "content": a.system})
    turns = list(a.message) if a.message else None  # --message is repeatable: one user turn each
    while True:
        if turns is not None:
            if not turns:
                return 0
            text = turns.pop(0)
        else:
            try:
                text = input("you> ").strip()
            except EOFError:
                return 0
            if text in ("", "/exit", "/quit"):
                return 0
        history.append({"role": "user", "content": text})
        t = time.perf_counter()
        out = llm.chat(history, _params(a), use_tqdm=False)[0]
        dt = time.perf_counter() - t
        reply = out.outputs[0].text
        print(f"assistant> {reply}")
        print(_summary(llm, [out], dt))
        history.append({"role": "assistant", "content": reply})


def cmd_serve(a) -> int:
    from minivllm.engine.async_llm import AsyncLLM
    from minivllm.entrypoints.openai import cli_args
    from minivllm.entrypoints.openai.api_server import DEFAULT_MODEL_NAME, run_server

    engine_client = AsyncLLM.from_engine_args(
        a.model, dtype=a.dtype, device=a.device, block_size=a.block_size, num_gpu_blocks=a.num_gpu_blocks,
        max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len,
        enable_prefix_caching=not a.no_prefix_caching, seed=a.seed, tensor_parallel_size=a.tensor_parallel_size,
        scheduler_cls=a.scheduler_cls,
    )
    name = a.served_model_name or (a.model if a.model is not None else DEFAULT_MODEL_NAME)
    print(f"[minivllm] serving {name!r} on http://{a.host}:{a.port}/v1", flush=True)
    return run_server(engine_client, name, a.host, a.port, cli_args.api_key(a), **cli_args.app_options(a))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minivllm", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="complete prompts")
    g.add_argument("prompts", nargs="+")
    _engine_args(g)
    c = sub.add_parser("chat", help="chat with the model")
    c.add_argument("--message", action="append", help="a user turn (repeatable); without it, read from stdin")
    c.add_argument("--system", default=None, help="a system prompt")
    _engine_args(c)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (like vllm serve)",
                       epilog="On a CPU, float32 runs through minivllm's kernels and packed oneDNN weights, as "
                              "vLLM's CPU build does; MINIVLLM_CPU_KERNELS_FP32=0 chooses the exact float32 "
                              "reference (PyTorch's operators: slower, bit for bit what the course checks).")
    s.add_argument("model", nargs="?", default=None,
                   help="a .gguf file, a Hugging Face folder or 'tiny' (default: SmolLM2-135M-Instruct)")
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    s.add_argument("--device", default=None, help="cpu (default) or cuda")
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--num-gpu-blocks", type=int, default=None)
    s.add_argument("--max-num-batched-tokens", type=int, default=None)
    s.add_argument("--max-num-seqs", type=int, default=None)
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument("--no-prefix-caching", action="store_true")
    s.add_argument("--seed", type=int, default=0, help="seed of requests without their own seed")
    s.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="worker processes that share every layer (vLLM's --tensor-parallel-size)")
    s.add_argument("--scheduler-cls", default=None,
                   help="the scheduler class as 'package.module.Class' (vLLM's --scheduler-cls)")
    # The server's own options, vLLM's names (fastapi and uvicorn load only when ``serve`` runs).
    from minivllm.entrypoints.openai.cli_args import add_server_args

    add_server_args(s)
    sub.add_parser("bench", help="benchmark (see python -m minivllm bench --help)", add_help=False)
    sub.add_parser("figures", help="regenerate images/ from real engine runs")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from minivllm.bench.cli import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["figures"]:
        from minivllm.course.figures import main as figures_main

        return figures_main(argv[1:])
    a = parser.parse_args(argv)
    return {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
