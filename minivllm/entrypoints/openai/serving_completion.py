"""``POST /v1/completions`` (vLLM 0.32: ``vllm/entrypoints/openai/completion/serving.py``).

The prompt is a string or a list of token ids (as in vLLM; the token-id form serves models without a tokenizer,
such as the tests' ``"tiny"``), or a one-element list of either: minivllm serves one prompt per request.
"""

from __future__ import annotations

from typing import AsyncGenerator, Dict, List, Union

from minivllm.entrypoints.openai.protocol import (CompletionRequest, CompletionResponse, CompletionResponseChoice,
                                                  CompletionStreamResponse, UsageInfo, random_uuid)
from minivllm.entrypoints.openai.serving_engine import (OpenAIServing, RequestError, completion_logprobs,
                                                       error_event, prompt_logprobs_json, usage_of)
from minivllm.outputs import RequestOutput


def _prompt(prompt: Union[str, List[int], List[str], List[List[int]]]) -> Union[str, List[int]]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise RequestError(f"prompt must be one prompt (minivllm serves no batches; use n for several "
                               f"completions), got a list of "
                               f"{len(prompt)} prompts", "prompt")
        prompt = prompt[0]
    return prompt  # type: ignore[return-value]  # one prompt: a str, or a list of ids


class OpenAIServingCompletion(OpenAIServing):
    """The completions endpoint: validate, queue, then answer whole or as server-sent events."""

    async def create_completion(self, request: CompletionRequest
                                ) -> Union[CompletionResponse, AsyncGenerator[str, None]]:
        """A ``CompletionResponse``, or (``stream=True``) an async generator of SSE ``data:`` lines.

        Raises:
            RequestError: 404 for another model; 400 for a bad parameter or prompt, before anything is queued.
        """
        self.check_model(request)
        if request.echo:
            raise RequestError("echo is not supported by minivllm's server", "echo")
        params = self.sampling_params(request)
        prompt = _prompt(request.prompt)
        if isinstance(prompt, str):
            self.check_text_length(prompt)  # before queueing for the tokenizer thread
            ids = await self.run_in_executor(self.tokenize, prompt)
        else:
            self.check_length(len(prompt))
            ids = prompt
        del prompt  # the engine gets the ids; a big text should not live as long as the request
        request_id = f"cmpl-{random_uuid()}"
        outputs = await self.start({"prompt_token_ids": ids}, params, request_id)
        model = self.served_model_name
        if request.stream:
            return self._stream(request, request_id, outputs)
        results = await self.collect(outputs)
        choices = [CompletionResponseChoice(
            index=r.index, text=r.text, finish_reason=r.finish_reason, stop_reason=r.stop_reason,
            token_ids=r.token_ids if request.return_token_ids else None,
            logprobs=None if r.logprobs is None or request.logprobs is None else
            completion_logprobs(self.tokenizer, r.token_ids, r.logprobs, request.logprobs),
            prompt_logprobs=prompt_logprobs_json(r.prompt_logprobs)) for r in results]
        return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage_of(results),
                                  prompt_token_ids=results[0].prompt_token_ids if request.return_token_ids else None)

    async def _stream(self, request: CompletionRequest, request_id: str,
                      outputs: AsyncGenerator[RequestOutput, None]) -> AsyncGenerator[str, None]:
        model, n_in, n_out = self.served_model_name, 0, 0
        offsets: Dict[int, int] = {}  # per choice: the text offset of its next token (vLLM's text_offset)
        try:
            async for out in outputs:
                n_in = len(out.prompt_token_ids)
                for c in out.outputs:
                    n_out += len(c.token_ids)
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue  # text held back by a stop-string window, and no token
                    stop = c.stop_reason if isinstance(c.stop_reason, (int, str)) else None
                    logprobs = None
                    if c.logprobs is not None and request.logprobs is not None:
                        logprobs = completion_logprobs(self.tokenizer, list(c.token_ids), c.logprobs,
                                                       request.logprobs, offsets.get(c.index, 0))
                        if logprobs.text_offset:
                            offsets[c.index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
                    choice = CompletionResponseChoice(
                        index=c.index, text=c.text, finish_reason=c.finish_reason, stop_reason=stop,
                        token_ids=list(c.token_ids) if request.return_token_ids else None, logprobs=logprobs,
                        prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs))
                    chunk = CompletionStreamResponse(id=request_id, model=model, choices=[choice])
                    yield f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
        except RequestError as e:  # the engine died: vLLM sends the error as an event, then [DONE]
            yield error_event(e)
            yield "data: [DONE]\n\n"
            return
        finally:
            await outputs.aclose()
        if request.stream_options and request.stream_options.include_usage:
            usage = UsageInfo(prompt_tokens=n_in, completion_tokens=n_out, total_tokens=n_in + n_out)
            chunk = CompletionStreamResponse(id=request_id, model=model, choices=[], usage=usage)
            yield f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
        yield "data: [DONE]\n\n"

