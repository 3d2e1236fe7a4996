"""The OpenAI server serves n, logprobs, prompt_logprobs, penalties, logit_bias and vLLM's seed range (issue 28
items 8 and 13), through the real ``openai`` client, equal to the offline engine."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
import httpx  # noqa: E402

from minivllm import LLM, LLMEngine, SamplingParams  # noqa: E402
from minivllm.engine.async_llm import AsyncLLM  # noqa: E402
from minivllm.entrypoints.openai.api_server import build_app  # noqa: E402
from tests.entrypoints.test_serving import ServerThread  # noqa: E402

NUM_BLOCKS, MAX_MODEL_LEN = 64, 256
PROMPT = [100, 200, 300, 400, 42, 17, 5, 99, 3, 1]


@pytest.fixture(scope="module")
def tiny():
    ref = LLM("tiny", num_gpu_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN)
    async_llm = AsyncLLM(LLMEngine(ref.llm_engine.model, num_gpu_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN))
    server = ServerThread(build_app(async_llm, "tiny"))
    yield ref, server
    server.stop()
    async_llm.shutdown()


def _client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=60)


def test_n_and_logprobs_through_the_openai_client_equal_offline(tiny):
    ref, server = tiny
    resp = _client(server).completions.create(model="tiny", prompt=PROMPT, max_tokens=6, n=3, seed=11,
                                              temperature=1.0, logprobs=2, extra_body={"ignore_eos": True,
                                                                                       "return_token_ids": True})
    want = ref.generate([{"prompt_token_ids": PROMPT}], SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=6,
                                                                       logprobs=2, ignore_eos=True),
                        use_tqdm=False)[0]
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert resp.usage.completion_tokens == 18 and resp.usage.prompt_tokens == len(PROMPT)
    for choice, w in zip(resp.choices, want.outputs):
        ids = choice.model_extra["token_ids"]
        assert ids == list(w.token_ids)
        lp = choice.logprobs
        assert lp.tokens == [f"token_id:{t}" for t in ids]  # no tokenizer: vLLM's token_id:<id> form
        assert lp.token_logprobs == pytest.approx([d[t].logprob for d, t in zip(w.logprobs, ids)], abs=1e-6)
        assert all(1 <= len(top) <= 3 and lp.tokens[i] in top for i, top in enumerate(lp.top_logprobs))
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]


def test_streaming_n_with_logprobs_gives_each_index_the_non_streaming_choice(tiny):
    _ref, server = tiny
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "n": 2, "seed": 3, "temperature": 1.0,
            "logprobs": 1, "ignore_eos": True, "return_token_ids": True}
    whole = httpx.post(server.base + "/v1/completions", json=body, timeout=60).json()
    got = {0: ([], []), 1: ([], [])}
    finished = set()
    with httpx.stream("POST", server.base + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    got[c["index"]][0].extend(c["token_ids"])
                    got[c["index"]][1].extend(c["logprobs"]["token_logprobs"])
                    if c.get("finish_reason"):
                        finished.add(c["index"])
    assert finished == {0, 1}
    for c in whole["choices"]:
        ids, lps = got[c["index"]]
        assert ids == c["token_ids"] and lps == pytest.approx(c["logprobs"]["token_logprobs"], abs=1e-6)


def test_penalties_bias_seed_and_prompt_logprobs_are_served(tiny):
    ref, server = tiny
    c = _client(server)
    greedy = dict(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                  extra_body={"ignore_eos": True, "return_token_ids": True})
    first = c.completions.create(**greedy).choices[0].model_extra["token_ids"]
    biased = c.completions.create(**greedy, logit_bias={str(first[0]): -100}).choices[0].model_extra["token_ids"]
    assert biased[0] != first[0]
    pen = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, frequency_penalty=2.0,
                               presence_penalty=1.0, extra_body={"ignore_eos": True, "return_token_ids": True,
                                                                 "repetition_penalty": 1.5})
    want = ref.generate([{"prompt_token_ids": PROMPT}], SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, frequency_penalty=2.0, presence_penalty=1.0,
        repetition_penalty=1.5), use_tqdm=False)[0].outputs[0].token_ids
    assert pen.choices[0].model_extra["token_ids"] == list(want)
    r = httpx.post(server.base + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2,
                                                          "seed": -1, "prompt_logprobs": 1}, timeout=60)
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(PROMPT) and all(str(t) in d for t, d in zip(PROMPT[1:], plp[1:]))
    r = httpx.post(server.base + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2,
                                                          "n": 2, "temperature": 0}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_chat_logprobs_and_n_real_model(real_llm):
    """Chat's ``logprobs: true`` + ``top_logprobs`` and ``n``, streaming and not, against the offline engine."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    eng = real_llm.llm_engine
    want = real_llm.chat(messages, SamplingParams(temperature=0, max_tokens=6, logprobs=2), use_tqdm=False)[0]
    want = want.outputs[0]
    async_llm = AsyncLLM(LLMEngine(eng.model, tokenizer=eng.tokenizer, num_gpu_blocks=64))
    server = ServerThread(build_app(async_llm, "smol"))
    try:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=60)
        resp = client.chat.completions.create(model="smol", messages=messages, max_tokens=6, temperature=0,
                                              logprobs=True, top_logprobs=2)
        content = resp.choices[0].logprobs.content
        assert [x.token for x in content] == [d[t].decoded_token for d, t in zip(want.logprobs, want.token_ids)]
        assert "".join(x.token for x in content) == want.text
        assert [x.logprob for x in content] == pytest.approx(
            [d[t].logprob for d, t in zip(want.logprobs, want.token_ids)], abs=1e-5)
        assert all(len(x.top_logprobs) == 2 and x.top_logprobs[0].token == x.token for x in content)  # greedy
        assert all(x.bytes == list(x.token.encode()) for x in content)
        resp = client.chat.completions.create(model="smol", messages=messages, max_tokens=4, temperature=0.8,
                                              n=2, seed=1)
        assert [c.index for c in resp.choices] == [0, 1]
        seen = set()
        for chunk in client.chat.completions.create(model="smol", messages=messages, max_tokens=4, temperature=0.8,
                                                    n=2, seed=1, stream=True, logprobs=True):
            for c in chunk.choices:
                seen.add(c.index)
                if c.delta.content:
                    assert c.logprobs.content
        assert seen == {0, 1}
        with pytest.raises(openai.BadRequestError, match="top_logprobs"):
            client.chat.completions.create(model="smol", messages=messages, max_tokens=2, top_logprobs=2)
    finally:
        server.stop()
        async_llm.shutdown()
