"""Incremental detokenization and stop strings (vLLM: ``vllm/v1/engine/detokenizer.py``).

Text is produced token by token with ``tokenizers``' ``DecodeStream``, which holds back bytes that do not yet
form a whole character (a multi-byte UTF-8 character can span several byte-level BPE tokens).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from minivllm.sampling_params import SamplingParams


class IncrementalDetokenizer:
    """Detokenizes one request's output as it grows and watches for stop strings.

    Stop strings are looked for in the new text plus the ``len(longest stop) - 1`` characters before it, so a stop
    string split across tokens is found. As in vLLM (``vllm/v1/engine/detokenizer.py``, ``check_stop_strings``):
    nothing is checked until more than ``min_tokens`` tokens exist, the stop strings are tried in list order and the
    first one found wins, and the text is cut before it (or after it, with ``include_stop_str_in_output``).
    """

    def __init__(self, tokenizer, params: SamplingParams) -> None:
        from tokenizers.decoders import DecodeStream

        self._tok = tokenizer._tokenizer if hasattr(tokenizer, "_tokenizer") else tokenizer
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self.params = params
        self.output_text = ""
        self._max_stop = max((len(s) for s in params.stop), default=0)
        self.num_tokens = 0

    def update(self, new_token_ids: List[int]) -> Tuple[str, Optional[str]]:
        """Feed new tokens. Returns ``(new text, matched stop string or None)``."""
        before = len(self.output_text)
        self.num_tokens += len(new_token_ids)
        for t in new_token_ids:
            piece = self._stream.step(self._tok, t)
            if piece:
                self.output_text += piece
        stop = self._check_stop(before)
        return self.output_text[before:], stop

    def _check_stop(self, new_from: int) -> Optional[str]:
        if not self._max_stop or self.num_tokens <= self.params.min_tokens:
            return None
        start = max(0, new_from - self._max_stop + 1)
        for s in self.params.stop:
            i = self.output_text.find(s, start)
            if i != -1:
                keep = i + len(s) if self.params.include_stop_str_in_output else i
                self.output_text = self.output_text[:keep]
                return s
        return None
