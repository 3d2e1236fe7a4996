"""``POST /v1/chat/completions`` (vLLM 0.32: ``vllm/entrypoints/openai/chat_completion/serving.py``).

The conversation is rendered with the model's chat template to text (``tokenize=False``), and that text is
tokenized like any prompt (``add_special_tokens=False``), both on the server's tokenizer thread; this gives the
token ids ``LLM.chat`` gets (the tests check it token for token). A message's ``content`` may be a string or
OpenAI's list of ``{"type": "text", "text": ...}`` parts; other part types are refused.
"""

from __future__ import annotations

from typing import AsyncGenerator, Dict, List, Union

from minivllm.entrypoints.openai.protocol import (ChatCompletionRequest, ChatCompletionResponse,
                                                  ChatCompletionResponseChoice, ChatCompletionResponseStreamChoice,
                                                  ChatCompletionStreamResponse, ChatResponseMessage, DeltaMessage,
                                                  UsageInfo, random_uuid)
from minivllm.entrypoints.openai.serving_engine import (OpenAIServing, RequestError, chat_logprobs, error_event,
                                                       truncate, usage_of)
from minivllm.outputs import RequestOutput


class OpenAIServingChat(OpenAIServing):
    """The chat endpoint: apply the chat template, queue, then answer whole or as server-sent events."""

    def render(self, request: ChatCompletionRequest) -> str:
        """The prompt text of the conversation. Raises ``RequestError`` (400, ``messages``) when it cannot be built."""
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer and no chat template; use /v1/completions with token "
                               "ids", "messages")
        if not request.messages:
            raise RequestError("messages must be a non-empty list", "messages")
        messages: List[Dict[str, str]] = []
        for m in request.messages:
            content = m.content
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise RequestError(f"messages: only text content parts are supported, got "
                                           f"{truncate(repr(part), 200)}", "messages")
                    parts.append(part["text"])
                content = "".join(parts)
            messages.append({"role": m.role, "content": content or ""})
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=request.add_generation_prompt)
        except Exception as e:  # a template that rejects the conversation (roles out of order, ...)
            raise RequestError(f"messages: the chat template failed: {e}", "messages") from None

    def render_and_tokenize(self, request: ChatCompletionRequest) -> List[int]:
        """The conversation's prompt token ids (on the tokenizer thread)."""
        for m in request.messages:  # the template adds to the text: a conversation longer than the bound cannot fit
            if isinstance(m.content, str):
                self.check_text_length(m.content, "messages")
        return self.tokenize(self.render(request), "messages")

    async def create_chat_completion(self, request: ChatCompletionRequest
                                     ) -> Union[ChatCompletionResponse, AsyncGenerator[str, None]]:
        """A ``ChatCompletionResponse``, or (``stream=True``) an async generator of SSE ``data:`` lines.

        Raises:
            RequestError: 404 for another model; 400 for a bad parameter or conversation, before anything is queued.
        """
        self.check_model(request)
        params = self.sampling_params(request)
        if self.tokenizer is None:
            self.render(request)  # raises the "no tokenizer" 400 without a trip to the tokenizer thread
        ids = await self.run_in_executor(self.render_and_tokenize, request)
        request_id = f"chatcmpl-{random_uuid()}"
        outputs = await self.start({"prompt_token_ids": ids}, params, request_id)
        if request.stream:
            return self._stream(request, request_id, outputs)
        results = await self.collect(outputs)
        top = request.top_logprobs or 0
        choices = [ChatCompletionResponseChoice(
            index=r.index, message=ChatResponseMessage(content=r.text), finish_reason=r.finish_reason,
            stop_reason=r.stop_reason, token_ids=r.token_ids if request.return_token_ids else None,
            logprobs=None if r.logprobs is None else chat_logprobs(self.tokenizer, r.token_ids, r.logprobs, top))
            for r in results]
        return ChatCompletionResponse(id=request_id, model=self.served_model_name, choices=choices,
                                      usage=usage_of(results),
                                      prompt_token_ids=results[0].prompt_token_ids if request.return_token_ids else None)

    async def _stream(self, request: ChatCompletionRequest, request_id: str,
                      outputs: AsyncGenerator[RequestOutput, None]) -> AsyncGenerator[str, None]:
        model, n_in, n_out = self.served_model_name, 0, 0

        def event(choices: List[ChatCompletionResponseStreamChoice], usage=None) -> str:
            chunk = ChatCompletionStreamResponse(id=request_id, model=model, choices=choices, usage=usage)
            return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"

        # First chunk: the role alone, one per choice, as OpenAI and vLLM send it.
        for i in range(request.n):
            yield event([ChatCompletionResponseStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
        top = request.top_logprobs or 0
        try:
            async for out in outputs:
                n_in = len(out.prompt_token_ids)
                for c in out.outputs:
                    n_out += len(c.token_ids)
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue
                    stop = c.stop_reason if isinstance(c.stop_reason, (int, str)) else None
                    yield event([ChatCompletionResponseStreamChoice(
                        index=c.index, delta=DeltaMessage(content=c.text), finish_reason=c.finish_reason,
                        stop_reason=stop, token_ids=list(c.token_ids) if request.return_token_ids else None,
                        logprobs=None if c.logprobs is None else
                        chat_logprobs(self.tokenizer, list(c.token_ids), c.logprobs, top))])
        except RequestError as e:  # the engine died: vLLM sends the error as an event, then [DONE]
            yield error_event(e)
            yield "data: [DONE]\n\n"
            return
        finally:
            await outputs.aclose()
        if request.stream_options and request.stream_options.include_usage:
            yield event([], UsageInfo(prompt_tokens=n_in, completion_tokens=n_out, total_tokens=n_in + n_out))
        yield "data: [DONE]\n\n"
