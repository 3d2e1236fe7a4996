"""Incremental detokenization and stop strings (vLLM: ``vllm/v1/engine/detokenizer.py``).

Text is produced token by token with ``tokenizers``' ``DecodeStream``, which holds back bytes that do not yet
form a whole character (a multi-byte UTF-8 character can span several byte-level BPE tokens).

Streaming and stop strings: a stop string may be completed by a later token than the one that started it, and the
text before its start is all the caller may ever see. So, as in vLLM, while a request runs the last
``max(len(s) for s in stop) - 1`` characters are held back from every streamed text (delta or cumulative) and
released when new text pushes them out or when the request finishes; with ``include_stop_str_in_output=True``
nothing is held back (the stop string itself stays in the text).

Where minivllm differs from vLLM: the stream is not primed with the prompt's ids (vLLM passes them to
``DecodeStream``), and tokens past the one that completed a stop string are not dropped here: minivllm's engine
appends at most one token per request per step (no speculative decoding), so there are none.
"""

from __future__ import annotations

import sys
from typing import List, Optional, Tuple

from minivllm.sampling_params import SamplingParams


class IncrementalDetokenizer:
    """A request's output token ids, for a model without a tokenizer (no text, no stop strings).

    The subclass ``FastIncrementalDetokenizer`` adds text; ``from_new_request`` picks one.
    """

    def __init__(self) -> None:
        self.token_ids: List[int] = []
        self.output_text = ""

    @property
    def output_token_ids(self) -> List[int]:
        """The growing list itself, not a copy: handed out as the cumulative ``token_ids`` (see OutputProcessor)."""
        return self.token_ids

    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    def update(self, new_token_ids: List[int], stop_terminated: bool) -> Optional[str]:
        """Add the step's new tokens. Returns the stop string that matched (never, without a tokenizer)."""
        self.token_ids.extend(new_token_ids)
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        return ""

    @classmethod
    def from_new_request(cls, tokenizer, params: SamplingParams) -> "IncrementalDetokenizer":
        return cls() if tokenizer is None else FastIncrementalDetokenizer(tokenizer, params)


class FastIncrementalDetokenizer(IncrementalDetokenizer):
    """Detokenizes one request's output as it grows, watches for stop strings, and holds back streamed text.

    Args:
        tokenizer: a transformers fast tokenizer (its ``_tokenizer``) or a ``tokenizers.Tokenizer``.
        params: the request's ``SamplingParams`` (``stop``, ``min_tokens``, ``include_stop_str_in_output``,
            ``skip_special_tokens``).
    """

    def __init__(self, tokenizer, params: SamplingParams) -> None:
        from tokenizers.decoders import DecodeStream

        super().__init__()
        self._tok = tokenizer._tokenizer if hasattr(tokenizer, "_tokenizer") else tokenizer
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self.stop = list(params.stop)
        self.min_tokens = params.min_tokens
        self.include_stop_str_in_output = params.include_stop_str_in_output
        # Characters held back from streamed text while the request runs (vLLM: ``stop_buffer_length``).
        hold = self.stop and not self.include_stop_str_in_output
        self.stop_buffer_length = max(len(s) for s in self.stop) - 1 if hold else 0
        self._last_output_text_offset = 0

    def update(self, new_token_ids: List[int], stop_terminated: bool) -> Optional[str]:
        """Detokenize the step's new tokens, then look for stop strings; returns the one that matched, or None.

        ``stop_terminated``: the last token is EOS or a stop token id; its text is left out of the output unless
        ``include_stop_str_in_output`` (as in vLLM). A matched stop string cuts ``output_text`` before it (after
        it with ``include_stop_str_in_output``).
        """
        if not new_token_ids:
            return None
        skipped = None
        if stop_terminated and not self.include_stop_str_in_output:
            skipped, new_token_ids = new_token_ids[-1], new_token_ids[:-1]
        num_prev = len(self.token_ids)
        offsets = [len(self.output_text)]  # text length at each new token's boundary
        for t in new_token_ids:
            self.token_ids.append(t)
            self.output_text += self._stream.step(self._tok, t) or ""
            offsets.append(len(self.output_text))
        if skipped is not None:
            self.token_ids.append(skipped)
            offsets.append(len(self.output_text))
        if not self.stop or len(self.token_ids) <= self.min_tokens:
            return None
        # Only text of tokens beyond min_tokens may complete a stop string (vLLM PR 22014).
        check_from = offsets[max(self.min_tokens - num_prev, 0)]
        found = check_stop_strings(self.output_text, len(self.output_text) - check_from, self.stop,
                                   self.include_stop_str_in_output)
        if found is None:
            return None
        stop, truncate_to = found
        if truncate_to != -1:
            self.output_text = self.output_text[:truncate_to]
        return stop

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to hand out now: all of it (``delta=False``) or what is new since the last call (``delta``).

        While the request runs, the last ``stop_buffer_length`` characters are withheld; once ``finished``, all.
        """
        hold = 0 if finished else self.stop_buffer_length
        end = len(self.output_text) - hold
        if not delta:
            return self.output_text[:end] if hold else self.output_text
        start = self._last_output_text_offset
        if start >= end:
            return ""
        self._last_output_text_offset = end
        return self.output_text[start:end]


def check_stop_strings(output_text: str, new_char_count: int, stop: List[str],
                       include_in_output: bool) -> Optional[Tuple[str, int]]:
    """Look for a stop string in the last ``new_char_count`` characters (plus the overlap a string may need).

    Returns ``(stop string, truncate_to)`` or ``None``; ``truncate_to`` is the text length to keep, ``-1`` for all.
    As in vLLM 0.32 (``check_stop_strings``): when several match, the one that *completes* earliest wins (what
    adding one token at a time would find), ties going to the first in ``stop``.
    """
    if not new_char_count or not stop:
        return None
    best, best_start, best_end = None, 0, sys.maxsize
    for s in stop:
        start = output_text.find(s, max(len(output_text) - new_char_count - len(s) + 1, 0))
        if start != -1 and start + len(s) < best_end:
            best, best_start, best_end = s, start, start + len(s)
    if best is None:
        return None
    if include_in_output:
        return best, (-1 if best_end >= len(output_text) else best_end)
    return best, best_start
