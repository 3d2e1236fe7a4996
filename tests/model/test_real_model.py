"""minivllm on SmolLM2-135M equals Hugging Face transformers token for token (greedy, fp32)."""

import torch

from minivllm import SamplingParams
from minivllm.model.tokenizer import apply_chat_template

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
    "List three prime numbers.",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.",
]


def _prompts(tok):
    return [apply_chat_template(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]


def test_greedy_tokens_equal_transformers(real_llm, hf_model):
    tok = real_llm.get_tokenizer()
    prompts = _prompts(tok)
    # min_tokens masks EOS exactly like transformers' min_new_tokens, so both produce 32 tokens.
    params = SamplingParams(temperature=0, max_tokens=32, min_tokens=32)
    ours = real_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, o in zip(prompts, ours):
        with torch.no_grad():
            ref = hf_model.generate(
                torch.tensor([p]), max_new_tokens=32, do_sample=False, min_new_tokens=32, pad_token_id=2
            )[0, len(p):].tolist()
        assert o.outputs[0].token_ids == ref, tok.decode(p)


def test_last_position_logits_match(real_llm, hf_model):
    eng = real_llm.llm_engine
    tok = real_llm.get_tokenizer()
    eng.model_runner.keep_logits = True
    try:
        for p in _prompts(tok)[:5]:
            eng.add_request(None, {"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=1))
            eng.step()
            ours = eng.model_runner.last_inputs.logits[0]
            with torch.no_grad():
                ref = hf_model(torch.tensor([p])).logits[0, -1].float()
            assert torch.allclose(ours, ref, atol=1e-3, rtol=0), (ours - ref).abs().max()
    finally:
        eng.model_runner.keep_logits = False
        eng.run_to_completion()


def test_paris(real_llm):
    out = real_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                        SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert out.outputs[0].text == "The capital of France is Paris."
    assert out.outputs[0].finish_reason == "stop"


def test_loading_drops_the_parsed_gguf_and_keeps_the_config(real_llm):
    """The GGUF reader (233 MiB resident for SmolLM2's file) is gone once the weights are read; the config is kept
    on its own, and each caller gets its own copy."""
    from minivllm.model import config as C
    from minivllm.model.loader import default_model_path

    assert real_llm.llm_engine.model.config.vocab_size == 49152
    assert C._open_gguf.cache_info().currsize == 0
    path = default_model_path()
    hits = C._gguf_config.cache_info().hits
    a, b = C.get_config(path), C.get_config(path)
    assert a == b and a is not b
    assert C._gguf_config.cache_info().hits >= hits + 1
    assert C._open_gguf.cache_info().currsize == 0  # served from the config cache: no metadata parsed again
