"""Helpers of the scheduler (vLLM: ``vllm/v1/core/sched/utils.py``)."""

from __future__ import annotations

from minivllm.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Finish ``request`` if its last token ends it (vLLM ``vllm/v1/core/sched/utils.py:check_stop``, v0.32.0).

    The order is vLLM 0.32's: EOS first (``stop_reason`` stays ``None``; skipped with ``ignore_eos``), then
    ``stop_token_ids`` (``stop_reason`` is the token), then the length (``max_model_len`` or ``max_tokens``). So a
    token that is both the last one allowed and EOS or a stop token finishes the request with reason ``"stop"``,
    and its text is left out of the output like any stop token's. (Early V1 releases tested the length first.)
    ``min_tokens`` needs no check here: the sampler never lets EOS or a stop token through before ``min_tokens``
    tokens exist (in vLLM the ``min_tokens`` test after the length only gates repetition detection, which
    minivllm does not have). Stop *strings* are checked by the detokenizer.

    Sets ``request.status`` (and ``request.stop_reason`` for a stop token) and returns True when it finished.
    """
    sp = request.sampling_params
    last = request.output_token_ids[-1]
    if not sp.ignore_eos and request.eos_token_id is not None and last == request.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last in sp.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last
        return True
    if request.num_tokens >= max_model_len or (
        request.max_tokens is not None and request.num_output_tokens >= request.max_tokens
    ):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
