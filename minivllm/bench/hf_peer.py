"""The peer everybody already has: Hugging Face transformers' batched ``generate`` on the same weights.

This is *static batching*: a batch of ``batch_size`` prompts is left-padded to one length, prefilled together,
then decoded step by step until the batch's longest request is done; only then does the next batch start.
Requests that need fewer tokens than the batch's longest keep computing (their extra tokens are thrown away and
not counted). Timestamps come from a ``LogitsProcessor``, which ``generate`` calls once per step, after the
forward pass and before choosing the tokens.
"""

from __future__ import annotations

import time
from typing import List, Optional

import torch
from tqdm.auto import tqdm

from minivllm.bench.metrics import PeakMemory, RunResult, result_from_timestamps
from minivllm.bench.workload import Workload
from minivllm.model.llama import LlamaForCausalLM


def hf_model_from_minivllm(model: LlamaForCausalLM, dtype: Optional[torch.dtype] = None):
    """A ``transformers.LlamaForCausalLM`` holding copies of ``model``'s weights (same math, HF's code).

    minivllm stores fused ``qkv_proj`` and ``gate_up_proj`` weights (vLLM's layout); they are split back into
    Hugging Face's ``q/k/v_proj`` and ``gate/up_proj``. The q and k rows are already in Hugging Face's order
    (the GGUF loader undid llama.cpp's permutation). The HF config has no EOS id, so ``generate`` stops only at
    ``max_new_tokens`` (the benchmark's ``ignore_eos``).

    Args:
        model: a minivllm Llama.
        dtype: weight dtype of the copy (default: ``model``'s).

    Returns:
        The HF model in eval mode, on ``model``'s device.
    """
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    c = model.config
    dtype = dtype or next(model.parameters()).dtype
    device = next(model.parameters()).device
    hf_config = HFLlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id, eos_token_id=None, pad_token_id=None,
    )
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    sd = {}
    for name, w in model.state_dict().items():
        if name.endswith("qkv_proj.weight"):
            base = name[: -len("qkv_proj.weight")]
            sd[base + "q_proj.weight"], sd[base + "k_proj.weight"], sd[base + "v_proj.weight"] = w.split([q, kv, kv])
        elif name.endswith("gate_up_proj.weight"):
            base = name[: -len("gate_up_proj.weight")]
            sd[base + "gate_proj.weight"], sd[base + "up_proj.weight"] = w.chunk(2)
        else:
            sd[name] = w
    with torch.device("meta"):
        hf = HFLlama(hf_config)
    sd = {k: v.detach().to(device=device, dtype=dtype).clone() for k, v in sd.items()}
    if c.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    hf.load_state_dict(sd, strict=False, assign=True)
    if c.tie_word_embeddings:
        hf.tie_weights()
    missing = [n for n, p in hf.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"weights not copied into the transformers model: {missing[:5]}")
    # Buffers built on the meta device (rotary inv_freq) must be recomputed on the real device.
    hf.model.rotary_emb = type(hf.model.rotary_emb)(hf_config).to(device)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = None
    return hf.to(device).eval()


class _StepClock:
    """A ``LogitsProcessor`` that only records when each generation step's logits are ready."""

    def __init__(self) -> None:
        self.times: List[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def run_hf_generate(
    hf_model, workload: Workload, batch_size: int = 16, pad_token_id: int = 0, progress: bool = True
) -> RunResult:
    """Run ``workload`` through ``hf_model.generate`` in static, left-padded batches of ``batch_size`` (greedy).

    Requests are taken in workload order. Each batch generates the batch's largest ``max_tokens``; request
    ``i`` is credited with its first ``max_tokens[i]`` tokens only.

    Raises:
        ValueError: for ``batch_size < 1``.
    """
    from transformers import LogitsProcessorList

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = next(hf_model.parameters()).device
    n = workload.num_requests
    times: List[List[float]] = [[] for _ in range(n)]
    tokens: List[List[int]] = [[] for _ in range(n)]
    steps = 0
    bar = tqdm(total=n, desc=f"transformers {workload.name}", disable=not progress, unit="req", dynamic_ncols=True)
    with PeakMemory(device) as mem, torch.inference_mode():
        start = time.perf_counter()
        for b in range(0, n, batch_size):
            idx = list(range(b, min(b + batch_size, n)))
            width = max(len(workload.prompts[i]) for i in idx)
            ids = torch.full((len(idx), width), pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for row, i in enumerate(idx):
                p = workload.prompts[i]
                ids[row, width - len(p):] = torch.tensor(p)
                mask[row, width - len(p):] = 1
            new = max(workload.max_tokens[i] for i in idx)
            clock = _StepClock()
            out = hf_model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new, min_new_tokens=None,
                do_sample=False, num_beams=1, pad_token_id=pad_token_id, eos_token_id=None,
                logits_processor=LogitsProcessorList([clock]),
            )
            if device.type == "cuda":
                torch.cuda.synchronize()
            steps += len(clock.times)
            gen = out[:, width:].tolist()
            for row, i in enumerate(idx):
                m = workload.max_tokens[i]
                tokens[i] = gen[row][:m]
                times[i] = clock.times[:m]
            bar.update(len(idx))
        end = time.perf_counter()
    bar.close()
    config = {"dtype": str(next(hf_model.parameters()).dtype).replace("torch.", ""), "device": str(device),
              "batch_size": batch_size, "padding": "left", "attn_implementation": hf_model.config._attn_implementation}
    return result_from_timestamps("transformers", workload, times, start, end, token_ids=tokens,
                                  peak_mem_mib=mem.peak_mib, num_steps=steps, config=config)
