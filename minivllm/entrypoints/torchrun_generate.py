"""Greedy generation with tensor parallelism under ``torchrun`` (vLLM's ``distributed_executor_backend=
"external_launcher"``; its example is ``examples/offline_inference/torchrun_example.py``).

Every rank runs this same script and the same engine (``ExecutorWithExternalLauncher`` in
``minivllm/executor/uniproc_executor.py``); rank 0 prints.
One machine, two ranks::

    OMP_NUM_THREADS=1 torchrun --nproc-per-node=2 -m minivllm.entrypoints.torchrun_generate --model tiny-tp

Two machines, one rank each (A's address reachable from B; gloo on CPUs, NCCL with ``--device cuda``)::

    # on A                                        # on B: the same with --node-rank=1
    torchrun --nnodes=2 --nproc-per-node=1 --node-rank=0 --master-addr=A --master-port=29500 \\
        -m minivllm.entrypoints.torchrun_generate --model tiny-tp --tensor-parallel-size 2

SmolLM2-135M (the default ``--model``) has 9 query and 3 KV heads: it runs on 3 ranks, not 2.

(gloo picks the network interface from the host name; set ``GLOO_SOCKET_IFNAME`` if it picks the wrong one.)
"""

from __future__ import annotations

import argparse
import json
import os
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF path, a Hugging Face folder or a built-in name "
                        "(default: SmolLM2-135M-Instruct)")
    parser.add_argument("--tensor-parallel-size", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    parser.add_argument("--device", default=None)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable); token ids for built-in models")
    args = parser.parse_args(argv)

    from minivllm import LLM, SamplingParams

    llm = LLM(args.model, tensor_parallel_size=args.tensor_parallel_size, device=args.device,
              distributed_executor_backend="external_launcher" if args.tensor_parallel_size > 1 else None)
    if llm.get_tokenizer() is None:
        prompts = [[int(t) for t in p.split(",")] for p in (args.prompt or ["1,2,3,4,5", "7,8,9"])]
    else:
        prompts = args.prompt or ["The capital of France is", "Tensor parallelism splits"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens), use_tqdm=False)
    if int(os.environ.get("RANK", "0")) == 0:
        for out in outs:
            print(json.dumps({"prompt": out.prompt_token_ids, "token_ids": list(out.outputs[0].token_ids),
                              "text": out.outputs[0].text}))
    llm.llm_engine.shutdown()


if __name__ == "__main__":
    main()
