"""Run an engine's requests to the end keeping every step's logits: the fast-path and compiled-graph tests compare
two engines step by step with it. Not a test module itself (no ``test_`` prefix)."""


def run_keeping_logits(eng, prompts, sp):
    """Add ``prompts`` (token id lists) to the idle engine ``eng`` as requests ``"0"``, ``"1"``, ... with
    ``SamplingParams`` ``sp`` and step it until all finish. Returns (logits of every step, tokens per request id)."""
    eng.model_runner.keep_logits = True
    for i, p in enumerate(prompts):
        eng.add_request(str(i), {"prompt_token_ids": p}, sp)
    logits, tokens = [], {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            tokens[o.request_id] = list(o.outputs[0].token_ids)
        logits.append(eng.model_runner.last_inputs.logits.clone())
    return logits, tokens
