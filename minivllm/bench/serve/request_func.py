"""One streaming ``POST /v1/completions`` request, timed on the client (vLLM 0.32:
``async_request_openai_completions`` in ``vllm/benchmarks/lib/endpoint_request_func.py``).

The prompt is sent as token ids (the benchmark's seeded random prompts need no tokenizer, and every server sees
the same tokens), greedy, ``ignore_eos`` (vLLM's extra field, minivllm's too) so that every request produces
exactly ``max_tokens`` tokens. Timing: TTFT is from sending the request to the first chunk carrying a choice; each
later such chunk adds one inter-token latency (ITL); the end-to-end latency ends at the last such chunk (the
usage chunk and ``[DONE]`` after it are not counted, as in vLLM); the output token count comes from the final ``usage`` chunk
(``stream_options.include_usage``). A chunk may carry more than one token (a server may bundle them): its gap is
one ITL, as in vLLM's benchmark; TPOT, ``(latency - ttft) / (output_tokens - 1)``, is not affected by bundling.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import List, Optional

import httpx


@dataclass
class RequestFuncInput:
    """What to send.

    Attributes:
        prompt: prompt token ids.
        output_len: ``max_tokens`` (exactly this many are generated: greedy, ``ignore_eos``).
        model: the served model name.
        api_url: the completions URL, e.g. ``http://127.0.0.1:8000/v1/completions``.
        api_key: sent as ``Authorization: Bearer <key>`` when not ``None``.
    """

    prompt: List[int]
    output_len: int
    model: str
    api_url: str
    api_key: Optional[str] = None


@dataclass
class RequestFuncOutput:
    """What came back, in seconds of ``time.perf_counter()`` on the client.

    Attributes:
        success: a 200 response streamed to ``[DONE]`` with ``output_len`` tokens in its usage.
        start_time: when the request was sent.
        ttft: time to the first chunk with a choice.
        itl: the gaps between later chunks with a choice.
        latency: time to the end of the stream.
        output_tokens: ``usage.completion_tokens`` of the final chunk (0 without one).
        prompt_len: prompt tokens (``usage.prompt_tokens`` when given).
        error: the reason of a failure (HTTP status and body, or the exception).
    """

    success: bool = False
    start_time: float = 0.0
    ttft: float = 0.0
    itl: List[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0
    prompt_len: int = 0
    error: str = ""


async def async_request_openai_completions(inp: RequestFuncInput, client: httpx.AsyncClient) -> RequestFuncOutput:
    """Send ``inp`` as a streaming completion and time its chunks. Never raises for a failed request: the
    failure is returned (``success=False`` and ``error``) so that one bad request does not end the run."""
    payload = {"model": inp.model, "prompt": inp.prompt, "max_tokens": inp.output_len, "temperature": 0.0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {inp.api_key}"} if inp.api_key else {}
    out = RequestFuncOutput(prompt_len=len(inp.prompt))
    st = out.start_time = time.perf_counter()
    last, first = st, True
    try:
        async with client.stream("POST", inp.api_url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                out.error = f"HTTP {response.status_code}: {body[:500]}"
                return out
            done = False
            async for line in response.aiter_lines():
                line = line.strip()
                if not line or line.startswith(":"):  # blank separators and SSE comments (pings)
                    continue
                data = line.removeprefix("data:").strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if first:
                        out.ttft, first = now - st, False
                    else:
                        out.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    out.output_tokens = int(chunk["usage"].get("completion_tokens") or 0)
                    out.prompt_len = int(chunk["usage"].get("prompt_tokens") or out.prompt_len)
            # vLLM: latency = the time of the last chunk that carries a choice (most_recent_timestamp), so
            # the usage chunk and [DONE] after it do not count.
            out.latency = last - st
            if not done:
                out.error = "the stream ended without 'data: [DONE]'"
            elif first:
                out.error = "the stream carried no choice"
            elif out.output_tokens != inp.output_len:
                out.error = f"expected {inp.output_len} output tokens (ignore_eos), usage says {out.output_tokens}"
            else:
                out.success = True
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        out.error = f"{type(e).__name__}: {e}"
    return out
