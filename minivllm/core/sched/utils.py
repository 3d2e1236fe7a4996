"""Helpers of the scheduler (vLLM: ``vllm/v1/core/sched/utils.py``)."""

from __future__ import annotations

from minivllm.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Finish ``request`` if its last token ends it (vLLM ``vllm/v1/core/sched/utils.py:check_stop``).

    The length check comes first, as in vLLM: an EOS sampled as the last allowed token finishes the request
    with reason ``"length"``. ``min_tokens`` needs no check here: the sampler never lets EOS or a stop token
    through before ``min_tokens`` tokens exist. Stop *strings* are checked by the detokenizer.

    Sets ``request.status`` (and ``request.stop_reason`` for a stop token) and returns True when it finished.
    """
    if request.num_tokens >= max_model_len or (
        request.max_tokens is not None and request.num_output_tokens >= request.max_tokens
    ):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    sp = request.sampling_params
    last = request.output_token_ids[-1]
    if not sp.ignore_eos and request.eos_token_id is not None and last == request.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last in sp.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last
        return True
    return False
